"""One fuzzed request (a Probe) and how it ended (an Outcome), for `pagedserve bench fuzz`.

Contract: a Probe is everything needed to send the request again: the API (`http` or
`grpc`), the target (an HTTP path or a gRPC method), the exact bytes of the body (HTTP: the
JSON text as sent, lone surrogates and NaN included; gRPC: the serialized message, which
may hold invalid UTF-8), whether it streams and when the client leaves on purpose. It is
made from (seed, index) alone (pagedserve.benchmarks.fuzz_inputs), so a report's seed and index
reproduce it. An Outcome's `server_error` is the invariant the fuzzer checks: an HTTP
status >= 500, an error event of type server_error inside a 200 stream, a gRPC status
that is the server's fault (UNKNOWN, INTERNAL, UNAVAILABLE, DATA_LOSS, UNIMPLEMENTED), or no
answer at all (reset, timeout) where the client did not leave on purpose.
"""
from __future__ import annotations

from dataclasses import dataclass

SERVER_CODES = frozenset({"UNKNOWN", "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNIMPLEMENTED"})


@dataclass
class Probe:
    index: int
    category: str  # the generator that made it: numbers, unicode, structured, ...
    api: str  # "http" or "grpc"
    target: str  # "/v1/completions" or "/pagedserve.v1.Generation/Generate"
    body: bytes
    method: str = "POST"
    content_type: str = "application/json"
    stream: bool = False
    disconnect_after: int | None = None  # the client leaves after this many chunks or messages
    client_timeout: float | None = None  # the client leaves after this many seconds
    prefix: str | None = None  # the prompt starts with this text (shared with reference requests)
    fresh_prefix: bool = False  # no request used `prefix` before this one

    @property
    def leaves(self) -> bool:
        """The client leaves on purpose (a mid-request disconnect)."""
        return self.disconnect_after is not None or self.client_timeout is not None

    def describe(self, limit: int = 400) -> str:
        """The probe as a report shows it: target, flags and the start of the body."""
        flags = [f for f, on in (("stream", self.stream), ("fresh prefix", self.fresh_prefix)) if on]
        if self.disconnect_after is not None:
            flags.append(f"leaves after {self.disconnect_after} chunks")
        if self.client_timeout is not None:
            flags.append(f"leaves after {self.client_timeout:.2f} s")
        return f"{self.method} {self.target} [{', '.join(flags)}] {truncate(self.body, limit)}"


@dataclass
class Outcome:
    status: str  # "http 400", "grpc INVALID_ARGUMENT", "disconnected", "no answer: ReadError"
    server_error: bool
    detail: str = ""  # the start of the answer (error message, first text)
    seconds: float = 0.0


def truncate(data: bytes | str, limit: int) -> str:
    """`data` as printable text, its middle cut to keep it under about `limit` characters."""
    text = data.decode("utf-8", "backslashreplace") if isinstance(data, bytes) else data
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    if len(text) <= limit:
        return text
    return f"{text[:limit * 2 // 3]} ...[{len(text) - limit} characters]... {text[-limit // 3:]}"
