"""Sending a Probe and classifying how it ended, for both public APIs.

Contract: `send_http(client, base_url, probe, timeout)` and `send_grpc(channel, probe,
timeout)` never raise for anything the server does; they return an Outcome
(pagedserve.benchmarks.fuzz_probe). HTTP streams are read to the end (or until the client leaves on
purpose) and an error event of type server_error inside a 200 stream is a server error;
gRPC streams likewise. A probe that leaves (disconnect_after, client_timeout) ends
"disconnected" when it left before the server finished, else as the server ended it.
The HTTP client should not keep connections alive, so that a connection the server broke
is charged to the request that broke it.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass

import grpc
import httpx

from pagedserve.benchmarks.fuzz_probe import SERVER_CODES, Outcome, Probe, truncate

DETAIL = 300


@dataclass
class Connections:
    """Where the fuzzer sends: the HTTP API (a client without keep-alive) and the gRPC API."""
    http: httpx.AsyncClient
    base_url: str
    channel: grpc.aio.Channel
    model: str
    timeout: float  # seconds a request may take before it counts as unanswered


def _event_error(line: str) -> str | None:
    """The message of a `data: {"error": ...}` event of type server_error, else None."""
    if '"error"' not in line:
        return None
    try:
        error = json.loads(line[len("data:"):]).get("error")
    except (ValueError, AttributeError):
        return None
    if isinstance(error, dict) and error.get("type") == "server_error":
        return str(error.get("message"))
    return None


async def _read_stream(r: httpx.Response, probe: Probe) -> Outcome:
    events, tail = 0, ""
    async for line in r.aiter_lines():
        if not line.startswith("data:"):
            continue
        events += 1
        tail = line
        message = _event_error(line)
        if message is not None:
            return Outcome("http 200 + server_error event", True, truncate(message, DETAIL))
        if probe.disconnect_after is not None and events > probe.disconnect_after:
            return Outcome("disconnected", False)
    return Outcome("http 200", False, truncate(tail, DETAIL))


async def send_http(client: httpx.AsyncClient, base_url: str, probe: Probe, timeout: float) -> Outcome:
    headers = {"content-type": probe.content_type} if probe.content_type else {}
    start = time.monotonic()
    try:
        request = client.build_request(probe.method, base_url + probe.target, content=probe.body,
                                       headers=headers, timeout=probe.client_timeout or timeout)
        r = await client.send(request, stream=True)
        try:
            if r.status_code == 200 and r.headers.get("content-type", "").startswith("text/event-stream"):
                outcome = await _read_stream(r, probe)
            else:
                body = await r.aread()
                outcome = Outcome(f"http {r.status_code}", r.status_code >= 500, truncate(body, DETAIL))
        finally:
            await r.aclose()
    except httpx.TimeoutException as e:
        outcome = Outcome("disconnected", False) if probe.client_timeout else \
            Outcome(f"no answer: {type(e).__name__}", True)
    except httpx.HTTPError as e:
        outcome = Outcome(f"no answer: {type(e).__name__}", True, truncate(str(e), DETAIL))
    outcome.seconds = time.monotonic() - start
    return outcome


async def send_grpc(channel: grpc.aio.Channel, probe: Probe, timeout: float) -> Outcome:
    start = time.monotonic()
    messages = 0
    try:
        if not probe.stream:
            await channel.unary_unary(probe.target)(probe.body, timeout=timeout)
        else:
            call = channel.unary_stream(probe.target)(probe.body, timeout=timeout)
            async for _ in call:
                messages += 1
                if probe.disconnect_after is not None and messages > probe.disconnect_after:
                    call.cancel()
                    return Outcome("disconnected", False, seconds=time.monotonic() - start)
        outcome = Outcome("grpc OK", False)
    except grpc.aio.AioRpcError as e:
        code = e.code().name
        if code == "DEADLINE_EXCEEDED":
            outcome = Outcome("no answer: DEADLINE_EXCEEDED", True)
        else:
            outcome = Outcome(f"grpc {code}", code in SERVER_CODES, truncate(e.details() or "", DETAIL))
    outcome.seconds = time.monotonic() - start
    return outcome
