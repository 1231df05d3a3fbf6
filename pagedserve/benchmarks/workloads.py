"""Request length workloads for benchmarks: fixed, uniform, ShareGPT-like, Alpaca-like, traces.

Every workload is deterministic for a seed. Lengths are in tokens; prompts are random
token ids unless a trace gives text.
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass

WORKLOADS = ("random", "uniform", "sharegpt", "alpaca")


@dataclass
class BenchRequest:
    prompt_len: int
    output_len: int
    arrival: float = 0.0  # seconds after the start
    prompt: str | None = None  # trace text, when given


def _lognormal(rng: random.Random, mean: float, sigma: float) -> float:
    mu = math.log(mean) - sigma * sigma / 2  # so that the mean comes out at `mean`
    return rng.lognormvariate(mu, sigma)


def sample_lengths(workload: str, n: int, *, seed: int = 0, input_len: int = 128,
                   output_len: int = 128, min_len: int = 16, max_len: int = 512,
                   max_total: int = 2048) -> list[BenchRequest]:
    """Draw n (prompt, output) length pairs.

    random: every request input_len in, output_len out. uniform: both uniform in
    [min_len, max_len]. sharegpt: right-skewed, mean 161 in / 338 out, total capped at
    max_total. alpaca: mean 19 in / 58 out.
    """
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        if workload == "random":
            p, o = input_len, output_len
        elif workload == "uniform":
            p, o = rng.randint(min_len, max_len), rng.randint(min_len, max_len)
        elif workload in ("sharegpt", "alpaca"):
            mean_in, mean_out = (161, 338) if workload == "sharegpt" else (19, 58)
            while True:
                p = max(1, round(_lognormal(rng, mean_in, 0.9)))
                o = max(1, round(_lognormal(rng, mean_out, 0.8)))
                if p + o <= max_total:
                    break
        else:
            raise ValueError(f"unknown workload {workload!r}; choose one of {', '.join(WORKLOADS)} "
                             "or give a trace file")
        out.append(BenchRequest(p, o))
    return out


def poisson_arrivals(requests: list[BenchRequest], rate: float, seed: int = 0) -> None:
    """Set arrival times of a Poisson process at `rate` requests/s (inf: all at once)."""
    rng = random.Random(seed + 1)
    t = 0.0
    for r in requests:
        r.arrival = t
        if math.isfinite(rate):
            t += rng.expovariate(rate)


def load_trace(path: str) -> list[BenchRequest]:
    """JSONL, one request a line: {"arrival": s, "prompt": text | "prompt_len": n, "output_len": n}."""
    out = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                prompt = row.get("prompt")
                plen = int(row["prompt_len"]) if prompt is None else 0
                out.append(BenchRequest(plen, int(row["output_len"]), float(row.get("arrival", 0.0)),
                                        prompt))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{i}: expected an object with arrival, prompt or "
                                 f"prompt_len, and output_len ({e})") from None
    return out


def random_prompt_ids(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    return [rng.randrange(vocab_size) for _ in range(length)]
