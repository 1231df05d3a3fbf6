"""A bounded soak of a running gateway: many requests, some cancelled, some with short
deadlines; every one must end completed, cancelled or refused with a clear status, and
memsvc must hold no block afterwards (asked with the services' internal token,
--internal-token or PAGEDSERVE_INTERNAL_TOKEN).

    python -m pagedserve.benchmarks.soak --server 127.0.0.1:50051 --memsvc 127.0.0.1:50052 \\
        --requests 2000 --concurrency 64 --pids GATEWAY_PID,MEMSVC_PID

Prompts are random words (1 to --max-prompt-words), outputs 1 to --max-tokens tokens with
ignore_eos (so a completed request has exactly its max_tokens). --cancel of the requests
are cancelled after 0 to 4 streamed messages, --short-deadline of them get a deadline of
10 to 300 ms; a client refused with RESOURCE_EXHAUSTED waits 50 to 250 ms before its next
request. Process memory (VmRSS of --pids) is sampled as each quarter of the requests
completes. The report is one JSON object; the exit status is 1 when a request ended any
other way or blocks stayed referenced.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass

import grpc

from pagedserve.gateway.config import GatewayConfig
from pagedserve.rpc.grpc_service import open_channel
from pagedserve.wire.settings import add_flags
from pagedserve.wire.v1 import generation_pb2 as pb
from pagedserve.wire.v1 import generation_pb2_grpc as pb_grpc
from pagedserve.wire.v1 import memory_pb2, memory_pb2_grpc

CLEAR = {"completed", "cancelled", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"}
WORDS = ("the cache block page token model river stone light paper seven quick brown fox over "
         "lazy dog memory kernel table prefix shared copy write serve batch step").split()


@dataclass
class SoakConfig:
    requests: int = 2000
    concurrency: int = 64
    max_prompt_words: int = 120
    max_tokens: int = 64
    cancel: float = 0.10
    short_deadline: float = 0.05
    seed: int = 0
    api_key: str | None = None


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


async def _one(stub, i: int, cfg: SoakConfig, rng: random.Random, metadata) -> tuple[str, str]:
    """(outcome, detail) of request i."""
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, cfg.max_prompt_words)))
    max_tokens = rng.randint(1, cfg.max_tokens)
    roll = rng.random()
    cancel_after = rng.randint(0, 4) if roll < cfg.cancel else None
    timeout = rng.uniform(0.01, 0.3) if cfg.cancel <= roll < cfg.cancel + cfg.short_deadline else 300.0
    call = stub.Generate(pb.GenerateRequest(prompt=f"{i}: {words}", sampling=pb.SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True)), timeout=timeout, metadata=metadata)
    received = tokens = 0
    finish = ""
    try:
        async for r in call:
            received += 1
            tokens += len(r.token_ids)
            finish = r.finish_reason or finish
            if cancel_after is not None and received > cancel_after:
                call.cancel()
                return "cancelled", ""
        if cancel_after is not None and not finish:
            return "cancelled", ""
    except grpc.aio.AioRpcError as e:
        if cancel_after is not None and e.code() == grpc.StatusCode.CANCELLED:
            return "cancelled", ""
        return e.code().name, e.details() or ""
    except asyncio.CancelledError:
        return "cancelled", ""
    if finish != "length" or tokens != max_tokens:
        return "wrong_output", f"finish {finish!r}, {tokens} of {max_tokens} tokens"
    return "completed", ""


async def soak(server: str, memsvc: str | None, cfg: SoakConfig, pids: dict[str, int],
               token: str | None = None) -> dict:
    rng = random.Random(cfg.seed)
    seeds = [rng.randrange(1 << 30) for _ in range(cfg.requests)]
    metadata = [("authorization", f"Bearer {cfg.api_key}")] if cfg.api_key else None
    outcomes: dict[str, int] = {}
    details: dict[str, str] = {}
    rss: dict[str, list[int]] = {name: [] for name in pids}
    done = 0
    next_index = 0
    start = time.monotonic()
    async with grpc.aio.insecure_channel(server) as channel:
        stub = pb_grpc.GenerationStub(channel)

        async def worker():
            nonlocal done, next_index
            while next_index < cfg.requests:
                i = next_index
                next_index += 1
                outcome, detail = await _one(stub, i, cfg, random.Random(seeds[i]), metadata)
                if outcome == "RESOURCE_EXHAUSTED":  # a refused client backs off
                    await asyncio.sleep(random.Random(seeds[i]).uniform(0.05, 0.25))
                outcomes[outcome] = outcomes.get(outcome, 0) + 1
                if outcome not in CLEAR:
                    details.setdefault(outcome, detail)
                done += 1
                if done % max(cfg.requests // 4, 1) == 0:
                    for name, pid in pids.items():
                        rss[name].append(rss_bytes(pid))

        await asyncio.gather(*(worker() for _ in range(cfg.concurrency)))
    duration = time.monotonic() - start
    report = {"config": asdict(cfg), "duration_s": round(duration, 1), "outcomes": outcomes,
              "unclear": details, "rss_bytes_by_quarter": rss}
    if memsvc:
        report["memsvc"] = await asyncio.to_thread(_settled_stats, memsvc, token)
    return report


def _settled_stats(memsvc: str, token: str | None = None, timeout: float = 30.0) -> dict:
    """memsvc's blocks and sequences once the last frees arrived (or after `timeout`), asked
    with the internal `token`."""
    deadline = time.monotonic() + timeout
    with open_channel(memsvc, token=token) as channel:
        stub = memory_pb2_grpc.MemoryManagerStub(channel)
        while True:
            s = stub.Stats(memory_pb2.StatsRequest(), timeout=5)
            if (s.blocks_referenced == 0 and s.num_sequences == 0) or time.monotonic() > deadline:
                return {"blocks_referenced": s.blocks_referenced, "num_sequences": s.num_sequences,
                        "num_preemptions": s.num_preemptions, "prefix_cache_hits": s.prefix_cache_hits}
            time.sleep(0.2)


def ok(report: dict) -> bool:
    clear = set(report["outcomes"]) <= CLEAR
    return clear and report.get("memsvc", {}).get("blocks_referenced", 0) == 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pagedserve.benchmarks.soak", description=__doc__.splitlines()[0])
    p.add_argument("--server", required=True, help="the gateway, host:port")
    p.add_argument("--memsvc", default=None, help="memsvc, host:port: check that no block stays referenced")
    add_flags(p, GatewayConfig, only={"internal_token"})  # to ask memsvc
    p.add_argument("--pids", default="", help="NAME=PID,... whose memory to sample (e.g. gateway=123)")
    for f in ("requests", "concurrency", "max_prompt_words", "max_tokens", "seed"):
        p.add_argument("--" + f.replace("_", "-"), type=int, default=getattr(SoakConfig, f))
    p.add_argument("--cancel", type=float, default=SoakConfig.cancel)
    p.add_argument("--short-deadline", type=float, default=SoakConfig.short_deadline)
    p.add_argument("--api-key", default=None)
    args = p.parse_args(argv)
    cfg = SoakConfig(args.requests, args.concurrency, args.max_prompt_words, args.max_tokens, args.cancel,
                     args.short_deadline, args.seed, args.api_key)
    pids = dict((kv.split("=")[0], int(kv.split("=")[1])) for kv in args.pids.split(",") if kv)
    report = asyncio.run(soak(args.server, args.memsvc, cfg, pids, args.internal_token))
    print(json.dumps(report, indent=1))
    return 0 if ok(report) else 1


if __name__ == "__main__":
    sys.exit(main())
