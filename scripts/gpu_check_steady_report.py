"""The steady part's figures from the executor's step records (gpu_check_steady_hook.py): the
share of the run's wall time the device spent inside steps (CUDA events) and the device's busy
share over a profiled window (the torch profiler: the union of kernels, copies and sets), and
each decode-only step's time against its memory roofline:

    bytes read = the weights a step reads (all but the input embedding, of which it reads a
                 row a token) + the K/V of every sequence's context (2 x layers x kv_heads x
                 head_dim x element bytes a token);
    roofline   = bytes read / the device-to-device copy bandwidth measured in the same run
                 (counting read and write, as gpu_check's bench part does).

On a CPU (the rehearsal) the host's times stand in for the device's, and `clock` says which.
No torch here: plain numbers in, plain numbers out.
"""
from __future__ import annotations

import statistics

BATCH_BUCKETS = ((1, 1), (2, 8), (9, 32), (33, 64), (65, 128), (129, 256), (257, 1 << 30))


def model_bytes(named_numels, element_bytes: int, layers: int, kv_heads: int, head_dim: int) -> dict:
    """(name, numel) of every parameter: the bytes a decode step reads beyond the K/V, and the
    K/V bytes a context token adds."""
    weights = sum(n for name, n in named_numels if "embed_tokens" not in name) * element_bytes
    return {"weight_bytes": weights, "kv_bytes_per_token": 2 * layers * kv_heads * head_dim * element_bytes}


def roofline_ms(step: dict, sizes: dict, copy_gb_per_s: float) -> float:
    read = sizes["weight_bytes"] + step["context"] * sizes["kv_bytes_per_token"]
    return read / (copy_gb_per_s * 1e9) * 1e3


def bucket_of(seqs: int) -> str:
    lo, hi = next(b for b in BATCH_BUCKETS if b[0] <= seqs <= b[1])
    return str(lo) if lo == hi else f"{lo}-{hi}" if hi < 1 << 30 else f">{lo - 1}"


def median(values):
    return statistics.median(values) if values else None


def decode_figures(steps: list[dict], key: str, sizes: dict, copy_gb_per_s: float) -> dict:
    """Median step time (`key`: device_ms or host_ms), roofline and their ratio, overall and by
    batch size."""
    rows = [(s, s[key], roofline_ms(s, sizes, copy_gb_per_s)) for s in steps
            if s.get("decode") and s.get("context") is not None and s.get(key) is not None]

    def summary(group):
        return {"steps": len(group), "median_seqs": median([s["seqs"] for s, _, _ in group]),
                "median_context_per_seq": median([s["context"] / s["seqs"] for s, _, _ in group]),
                "median_step_ms": median([t for _, t, _ in group]),
                "median_roofline_ms": median([r for _, _, r in group]),
                "median_ratio": median([t / r for _, t, r in group])}

    buckets: dict[str, list] = {}
    for row in rows:
        buckets.setdefault(bucket_of(row[0]["seqs"]), []).append(row)
    return {**summary(rows), "by_batch": {b: summary(g) for b, g in buckets.items()}} if rows else {"steps": 0}


def step_figures(hook: dict, run_start: float, run_end: float, sizes: dict, copy_gb_per_s: float) -> dict:
    """What the executor's records say of the run between run_start and run_end (time.time())."""
    if "error" in hook:
        return {"error": hook["error"]}
    steps = [s for s in hook["steps"] if run_start <= s["t"] <= run_end]
    cuda = bool(hook.get("cuda"))
    key = "device_ms" if cuda else "host_ms"
    out = {"hooked": hook.get("hooked"), "clock": "cuda events" if cuda else "host (no CUDA)",
           "steps": len(steps), "decode_steps": sum(1 for s in steps if s.get("decode")),
           "pending_steps": sum(1 for s in steps if s.get("pending")),
           "mean_seqs": statistics.fmean(s["seqs"] for s in steps) if steps and steps[0]["seqs"] is not None else None,
           "max_seqs": max((s["seqs"] or 0 for s in steps), default=0),
           "host_in_steps_share": sum(s["host_ms"] for s in steps) / 1e3 / (run_end - run_start)}
    if cuda and steps and all("device_ms" in s for s in steps):
        span = steps[-1]["device_end_ms"] - (steps[0]["device_end_ms"] - steps[0]["device_ms"])
        out["device_in_steps_share"] = sum(s["device_ms"] for s in steps) / span if span > 0 else None
    out["decode"] = decode_figures(steps, key, sizes, copy_gb_per_s)
    out["profile"] = profile_figures(hook, sizes, copy_gb_per_s)
    out["graphs"] = hook.get("graphs")  # the executor's whole life: steps replayed, steps run eagerly
    out["pieces"] = hook.get("pieces")  # prompt-step buckets captured and dropped
    return out


def profile_figures(hook: dict, sizes: dict, copy_gb_per_s: float) -> dict:
    """The profiled window: busy share, and each decode step's busy time against its roofline."""
    prof = hook.get("profile") or {}
    if not prof.get("steps"):
        return {"steps": 0, **({"error": prof["error"]} if "error" in prof else {"reason": "the run ended first"})}
    window = hook["steps"][prof["first_step"]:prof["first_step"] + prof["steps"]]
    per_step = [dict(s, busy_ms=ns / 1e6) for s, ns in zip(window, prof["per_step_busy_ns"])]
    return {"activities": prof["activities"], "steps": prof["steps"], "first_step": prof["first_step"],
            "events": prof["events"], "busy_share": prof["busy_ns"] / prof["wall_ns"] if prof["wall_ns"] else None,
            "wall_ms": prof["wall_ns"] / 1e6, "busy_ms_per_step": prof["busy_ns"] / 1e6 / prof["steps"],
            "decode": decode_figures(per_step, "busy_ms", sizes, copy_gb_per_s)}


def one_line(name: str, r: dict) -> str:
    """The line printed for one shape."""
    ps, peer, st = r.get("pagedserve") or {}, r.get("transformers_cb") or {}, r.get("steps") or {}
    parts = [f"steady {name}:"]
    if ps:
        parts.append(f"pagedserve {ps.get('completed')}/{r.get('num_requests')} done{' (CUT)' if ps.get('cut') else ''},"
                     f" {ps.get('output_token_throughput', 0):.0f} out tok/s, TPOT median"
                     f" {ps['tpot_s']['median'] * 1e3:.1f} p99 {ps['tpot_s']['p99'] * 1e3:.1f} ms, TTFT median"
                     f" {ps['ttft_s']['median']:.2f} s;")
    prof = st.get("profile") or {}
    if prof.get("busy_share") is not None:
        parts.append(f"busy {prof['busy_share']:.0%} ({prof['activities']} profiler, {prof['steps']} steps);")
    if st.get("device_in_steps_share") is not None:
        parts.append(f"in steps {st['device_in_steps_share']:.0%} (CUDA events);")
    if st.get("steps"):
        parts.append(f"{st.get('pending_steps', 0)} of {st['steps']} steps launched with outputs pending;")
    if st.get("graphs"):
        parts.append(f"CUDA graphs {st['graphs']['replays']} steps replayed, {st['graphs']['eager']} eager;")
    if st.get("pieces"):
        parts.append(f"piecewise buckets {len(st['pieces']['buckets'])} captured, dropped {st['pieces']['dropped']};")
    dec = st.get("decode") or {}
    if dec.get("steps"):
        parts.append(f"decode step {dec['median_step_ms']:.2f} ms vs roofline {dec['median_roofline_ms']:.2f} ms"
                     f" ({dec['median_ratio']:.1f}x, {st['clock']}) at {dec['median_seqs']:.0f} seqs;")
    if peer:
        parts.append(f"transformers CB {peer.get('completed')}/{peer.get('requests')}"
                     f"{' (CUT)' if peer.get('cut') else ''} {peer.get('output_token_throughput', 0):.0f} tok/s;")
    if r.get("vs_transformers"):
        parts.append(f"pagedserve/transformers {r['vs_transformers']:.2f}x")
    if r.get("error"):
        parts.append(f"error: {r['error'][:200]}")
    return " ".join(parts)
