"""The fuzzer against a running gateway: fuzzed requests, reference requests beside them,
/health polled all along, memsvc's blocks checked at the end.

Contract: `run(cfg, base_url, grpc_address)` sends `cfg.requests` probes
(pagedserve.benchmarks.fuzz_inputs, seed `cfg.seed`) to the HTTP API at `base_url` and the gRPC API at
`grpc_address`, `cfg.concurrency` at a time, and returns the report of
pagedserve.benchmarks.fuzz_report (check it with `violations`). Beside them:
- after every probe that used a fresh prefix, a reference request on that prefix in the
  same shape (chat after a chat probe; completions or gRPC Generate otherwise), compared
  with its fresh computation (pagedserve.benchmarks.fuzz_reference);
- all run long, one reference at a time on the shared prefixes (and, every fifth, on a
  prompt that shares nothing), every `cfg.reference_pause` seconds;
- a /health poll every `cfg.health_interval` seconds on its own thread.
When the last probe and reference are done it waits (up to `cfg.settle_timeout`) for
memsvc to hold no block and no sequence. The gateway must serve the HTTP API and
GET /v1/models (it reads the model's name and length there).
"""
from __future__ import annotations

import asyncio
import random
import time
from dataclasses import asdict, dataclass
from typing import Callable

import grpc
import httpx

from pagedserve.benchmarks.fuzz_http import Target
from pagedserve.benchmarks.fuzz_inputs import make_probe
from pagedserve.benchmarks.fuzz_prefixes import Prefixes
from pagedserve.benchmarks.fuzz_probe import Probe
from pagedserve.benchmarks.fuzz_reference import APIS, QUESTIONS, check
from pagedserve.benchmarks.fuzz_report import KEEP, Recorder
from pagedserve.benchmarks.fuzz_send import Connections, send_grpc, send_http
from pagedserve.benchmarks.fuzz_watch import HealthPoller, health_summary, settle

GRPC_OPTIONS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]


@dataclass
class FuzzConfig:
    requests: int = 300
    seed: int = 0
    concurrency: int = 4  # probes in flight at once (each followed by its reference, if any)
    reference_pause: float = 0.5  # seconds between the shared-prefix references
    health_interval: float = 0.05
    timeout: float = 120.0  # seconds before a request counts as unanswered
    settle_timeout: float = 60.0
    tag: str | None = None  # keeps the prefixes of two runs on one server apart (default: the seed)
    categories: tuple[str, ...] | None = None  # only these (pagedserve.benchmarks.fuzz_inputs.WEIGHTS); None: all


def _reference_apis(probe: Probe) -> tuple[str, ...]:
    """The reference APIs whose prompt shares the probe's prefix tokens."""
    return ("chat",) if probe.target.endswith(("/chat/completions", "/Chat")) else ("completions", "generate")


async def _target(http: httpx.AsyncClient, base_url: str) -> Target:
    card = (await http.get(base_url + "/v1/models", timeout=30)).json()["data"][0]
    return Target(card["id"], int(card["max_model_len"]))


async def _run(cfg: FuzzConfig, base_url: str, grpc_address: str, log: Callable[[str], None]) -> dict:
    recorder = Recorder()
    in_flight: dict[object, str] = {}
    prefixes = Prefixes(cfg.seed, cfg.tag)
    limits = httpx.Limits(max_keepalive_connections=0, max_connections=cfg.concurrency + 4)
    start = time.monotonic()
    poller = HealthPoller(base_url, cfg.health_interval, busy=lambda: list(in_flight.values())).start()
    try:
        async with httpx.AsyncClient(limits=limits) as http, \
                grpc.aio.insecure_channel(grpc_address, options=GRPC_OPTIONS) as channel:
            target = await _target(http, base_url)
            conns = Connections(http, base_url, channel, target.model, cfg.timeout)
            state = {"next": 0, "done": False}

            async def worker() -> None:
                while state["next"] < cfg.requests:
                    i = state["next"]
                    state["next"] += 1
                    probe = await asyncio.to_thread(make_probe, cfg.seed, i, target, prefixes,
                                                     cfg.categories)
                    in_flight[i] = f"#{i} {probe.category}"
                    if probe.api == "http":
                        outcome = await send_http(http, base_url, probe, cfg.timeout)
                    else:
                        outcome = await send_grpc(channel, probe, cfg.timeout)
                    recorder.probe(probe, outcome)
                    if probe.fresh_prefix:
                        rng = random.Random(f"reference/{cfg.seed}/{i}")
                        in_flight[i] = f"#{i} reference"
                        recorder.reference(await check(conns, rng.choice(_reference_apis(probe)), probe.prefix,
                                                       rng.choice(QUESTIONS), "fresh", f"#{i} {probe.category}"))
                    del in_flight[i]
                    if (i + 1) % max(cfg.requests // 10, 1) == 0:
                        log(f"fuzz: {i + 1}/{cfg.requests} requests, {recorder.server_error_count} server errors, "
                            f"{sum(r.mismatch for r in recorder.references)} reference mismatches")

            async def references() -> None:
                n = 0
                while not state["done"]:
                    kind = "none" if n % 5 == 4 else "shared"
                    prefix = prefixes.unique(n) if kind == "none" else prefixes.shared(n)
                    in_flight["reference"] = f"reference {kind}"
                    recorder.reference(await check(conns, APIS[n % len(APIS)], prefix,
                                                   QUESTIONS[n % len(QUESTIONS)], kind))
                    del in_flight["reference"]
                    n += 1
                    await asyncio.sleep(cfg.reference_pause)

            loop = asyncio.create_task(references())
            try:
                await asyncio.gather(*(worker() for _ in range(cfg.concurrency)))
            finally:
                state["done"] = True
                await loop
            after = await asyncio.to_thread(settle, base_url, cfg.settle_timeout)
    finally:
        polls = poller.stop()
    health = {**health_summary(polls), "notable": sorted(poller.notable, key=lambda s: -s["ms"])[:KEEP]}
    return recorder.report(asdict(cfg), time.monotonic() - start, health, after)


def run(cfg: FuzzConfig, base_url: str, grpc_address: str, log: Callable[[str], None] = lambda s: None) -> dict:
    return asyncio.run(_run(cfg, base_url.rstrip("/"), grpc_address, log))
