"""gpu_check's `services` part: memsvc, executor and gateway as separate processes sharing the
pool (CUDA IPC; POSIX shared memory without CUDA): float32 greedy, n=4 and beam 4 against
transformers token for token, SIGKILL of the executor mid-run, bfloat16 end to end against
transformers, swap under a tiny pool. Runs with or without CUDA.

gpu_check.py calls `part_services(args, part, work)`; services_ok judges its steps.
"""
from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING

from gpu_check_models import Services, bf16_against_transformers, build_model, hf_greedy, hf_sampled

if TYPE_CHECKING:
    from gpu_check import Part  # the runner's record of a part (no import at run time)


def part_services(args, part: Part, work: Path):
    import threading

    import torch

    from pagedserve.wire.protocol import SamplingParams

    def over(step):
        if not part.over():
            return False
        part.put("reason", f"time budget, before {step}")
        return True

    model_dir = build_model(work / "tiny-llama", hidden=512, layers=4, heads=8, kv_heads=2, inter=1024)
    # bfloat16: the serve part's attention shape (32 heads, 8 kv heads of 64), 2 layers, Llama's init
    bf16_dir = build_model(work / "tiny-llama-bf16", hidden=2048, layers=2, heads=32, kv_heads=8, inter=2048,
                           std=0.02, seed=1)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 4000, (n,), generator=gen).tolist() for n in (5, 17, 40, 100)]
    max_new = 24
    dtype = "float32"  # identity with transformers needs the same arithmetic's rounding
    part.put("model", "random Llama 512x4 (GQA 4)")
    part.put("dtype", dtype)
    part.put("pool_shared_by", "CUDA IPC" if str(args.device).startswith("cuda") else "POSIX shared memory (no CUDA)")
    # EOS may end a sequence on both sides (gpu_check.py's docstring): transformers stops at EOS,
    # and so does pagedserve without ignore_eos
    expected = hf_greedy(model_dir, prompts, max_new, dtype, args.device)
    beam_expected = hf_sampled(model_dir, prompts[2], dtype, args.device, max_new_tokens=12, num_beams=4,
                               num_return_sequences=4, do_sample=False, early_stopping=True)
    greedy = SamplingParams(max_tokens=max_new, temperature=0.0)
    if over("starting the services"):
        return {"status": "failed"}
    svc = Services(model_dir, args.device, dtype, log_dir=args.logs / "services").start(min(120, part.left()))
    try:
        if str(args.device).startswith("cuda"):  # no pool size given: what --gpu-memory-utilization left
            import torch

            free, total = torch.cuda.mem_get_info()
            part.put("pool_from_gpu_memory", {"total_slots": svc.memsvc_stats().snapshot.get("total_slots"),
                                              "device_total_gib": total / 2**30, "device_free_gib": free / 2**30})
        got = [svc.generate(ids, greedy)[0] for ids in prompts]
        part.put("greedy_equal", [g == e for g, e in zip(got, expected)])
        part.put("greedy_lengths", [len(e) for e in expected])
        if over("n=4"):
            return {"status": "failed"}
        n4 = svc.generate(prompts[1], SamplingParams(max_tokens=16, temperature=0.8, n=4, seed=7, ignore_eos=True))
        n4_again = svc.generate(prompts[1], SamplingParams(max_tokens=16, temperature=0.8, n=4, seed=7,
                                                           ignore_eos=True))
        n4_greedy = svc.generate(prompts[1], SamplingParams(max_tokens=16, temperature=0.0, n=4))
        part.put("n4", {"completions": len(n4), "lengths": [len(c) for c in n4], "seeded_repeat_equal": n4 == n4_again,
                        "distinct": len({tuple(c) for c in n4}),
                        "greedy_each_equal_transformers": [c == expected[1][:16] for c in n4_greedy]})
        beams = svc.generate(prompts[2], SamplingParams(max_tokens=12, beam_width=4, n=4, early_stopping=True))
        part.put("beam4", {"completions": len(beams), "equal_to_transformers": beams == beam_expected,
                           "first_equal": bool(beams) and beams[0] == beam_expected[0]})
        if over("SIGKILL of the executor"):
            return {"status": "failed"}
        # SIGKILL the executor mid-run: the gateway retries, the new executor maps the same pool.
        # The kill waits until memsvc holds every request's sequence (a fixed sleep landed after
        # the requests had ended), so it lands while they are provably running.
        outs, errors = {}, []
        kill_tokens = 128

        def run(i):
            try:
                outs[i] = svc.generate(prompts[i], SamplingParams(max_tokens=kill_tokens, temperature=0.0,
                                                                  ignore_eos=True))[0]
            except Exception as e:  # noqa: BLE001 - recorded
                errors.append(repr(e))

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        held, until = 0, time.monotonic() + 30
        while held < len(prompts) and time.monotonic() < until and not outs:
            held = svc.memsvc_stats().num_sequences
            time.sleep(0.005)
        finished = len(outs)
        svc.procs["executor"].send_signal(signal.SIGKILL)
        svc.procs["executor"].wait()
        svc.start_executor()
        for t in threads:
            t.join(max(1.0, part.left()))
        alone = [svc.generate(ids, SamplingParams(max_tokens=kill_tokens, temperature=0.0, ignore_eos=True))[0]
                 for ids in prompts]
        part.put("sigkill_executor", {"errors": errors, "sequences_held_at_kill": held,
                                      "finished_before_kill": finished,
                                      "same_outputs": [outs.get(i) == alone[i] for i in range(len(prompts))]})
    finally:
        svc.stop()
    if over("bfloat16 against transformers"):
        return {"status": "failed"}
    bf16 = Services(bf16_dir, args.device, "bfloat16", log_dir=args.logs / "bf16").start(min(120, part.left()))
    try:
        scored = [bf16.generate_scored(ids, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True,
                                                           logprobs=0)) for ids in prompts]
    finally:
        bf16.stop()
    part.put("bf16_vs_transformers", bf16_against_transformers(bf16_dir, prompts, scored, args.device))
    if over("swap under a tiny pool"):
        return {"status": "failed"}
    tiny = Services(model_dir, args.device, dtype, log_dir=args.logs / "swap",
                    extra_memsvc=["--kv-tokens", "256", "--preemption-mode", "swap", "--swap-space", "1"])
    tiny.start(min(120, part.left()))
    try:
        outs = {}
        threads = [threading.Thread(target=lambda i=i: outs.__setitem__(i, tiny.generate(
            prompts[i], SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))[0])) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(1.0, part.left()))
        preemption = tiny.memsvc_stats().preemption
        alone = [tiny.generate(ids, SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))[0]
                 for ids in prompts]
        part.put("swap_tiny_pool", {"same_outputs": [outs.get(i) == alone[i] for i in range(4)],
                                    "swapped_out": preemption["num_swapped_out"],
                                    "swapped_in": preemption["num_swapped_in"]})
    finally:
        tiny.stop()
    return {"status": "ok" if services_ok(part.result) else "failed"}


def services_ok(r: dict) -> bool:
    """Every step of the services part ran and passed (a missing step fails)."""
    try:
        kill, swap = r["sigkill_executor"], r["swap_tiny_pool"]
        return (all(r["greedy_equal"]) and r["n4"]["completions"] == 4 and r["n4"]["seeded_repeat_equal"]
                and len(r["n4"]["greedy_each_equal_transformers"]) == 4 and all(r["n4"]["greedy_each_equal_transformers"])
                and r["beam4"]["equal_to_transformers"] and not kill["errors"] and kill["sequences_held_at_kill"] > 0
                and kill.get("finished_before_kill", 0) == 0
                and all(kill["same_outputs"]) and r["bf16_vs_transformers"]["ok"] and all(swap["same_outputs"])
                and swap["swapped_out"] == swap["swapped_in"] > 0)
    except (KeyError, TypeError):
        return False
