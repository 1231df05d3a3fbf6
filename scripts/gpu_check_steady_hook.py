"""`pagedserve executor` with its steps timed, for gpu_check's steady part (gpu_check_steady.py):
`python scripts/gpu_check_steady_hook.py executor ARGS...` with STEADY_HOOK_OUT=FILE.

Wraps the executor class's `launch` (where it has one) or `execute` (pagedserve is not
edited): per step the host's wall time, the batch's shape (sequences, tokens, decode-only,
K/V context tokens), whether the launch returned with the outputs still on the device, and, on a GPU, the device's time between CUDA events recorded on the
current stream before and after the step. From the first step after FILE.go appears, the
torch profiler records PROFILE_STEPS steps (CUDA kernels, copies and sets; on a CPU its
operators): the union of their intervals over the window's wall time and within each step.
When FILE.dump appears, the records are written to FILE (JSON), with the executor's CUDA graph
counts (steps replayed, steps run eagerly beside graphs: Executor.graph_counts) and its
piecewise graphs' buckets (those captured, those dropped), and FILE.dump is removed.
Nothing here changes what a step computes.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections import deque
from pathlib import Path

PROFILE_AT = int(os.environ.get("STEADY_HOOK_PROFILE_AT", "200"))  # steps after FILE.go
PROFILE_STEPS = int(os.environ.get("STEADY_HOOK_PROFILE_STEPS", "50"))


def batch_shape(batch) -> dict:
    """Sequences, tokens, whether every sequence decodes one token, and the K/V context tokens
    its attention reads (each sequence's position after the step); None where unknown."""
    n, start = getattr(batch, "num_tokens", None), getattr(batch, "start_pos", None)
    if n is None or start is None:  # another batch type: recorded, not judged
        return {"seqs": None, "tokens": None, "decode": None, "context": None}
    return {"seqs": len(n), "tokens": int(n.sum()), "decode": bool((n == 1).all()),
            "context": int((start + n).sum())}


def union_ns(intervals) -> int:
    """The length covered by (start, end) intervals."""
    total, end = 0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total, end = total + (b - a), b
        elif b > end:
            total, end = total + (b - end), b
    return total


class StepClock:
    def __init__(self, out: Path):
        self.out, self.cuda = out, None  # cuda: set at the first step, from the executor's device
        self.executor = None  # the first step's: its CUDA graph counts go out with the records
        self.steps: list[dict] = []
        self.pending: deque = deque()  # (step record, start event, end event) not yet complete
        self.first = None  # the first step's start event: device offsets are measured from it
        self.go_step = None
        self.prof = self.window = None
        self.profile: dict = {"steps": 0}
        self.lock = threading.Lock()

    def wrap(self, fn):
        def timed(executor, batch, *args, **kwargs):
            if self.cuda is None:
                self.cuda = getattr(getattr(executor, "device", None), "type", "cpu") == "cuda"
                self.executor = executor
            self.before(batch)
            pending = False
            try:
                out = fn(executor, batch, *args, **kwargs)
                pending = type(getattr(out, "outputs", None)).__name__ == "PendingOutputs"
                return out
            finally:
                self.after(pending)
        return timed

    def before(self, batch):
        import torch

        with self.lock:
            self.current = {"t": time.time(), "ns": time.time_ns(), **batch_shape(batch)}
            index = len(self.steps)
            if self.go_step is not None and index == self.go_step + PROFILE_AT and self.prof is None:
                self.start_profile()
        if self.cuda:
            self.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self.events[0].record()
            if self.first is None:
                self.first = self.events[0]

    def after(self, pending: bool = False):
        step = self.current
        step["pending"] = pending  # launched with its outputs still on the device (ModelRunner.launch)
        if self.cuda:
            self.events[1].record()
        step["host_ms"] = (time.time_ns() - step["ns"]) / 1e6
        step["end_ns"] = time.time_ns()
        with self.lock:
            self.steps.append(step)
            if self.cuda:
                self.pending.append((step, *self.events))
                self.drain(block=False)
            if self.window is not None:
                self.window.append((step["ns"], step["end_ns"]))
                if len(self.window) >= PROFILE_STEPS:
                    self.stop_profile()

    def drain(self, block: bool):
        while self.pending and (block or self.pending[0][2].query()):
            step, start, end = self.pending.popleft()
            end.synchronize()
            step["device_ms"] = start.elapsed_time(end)
            step["device_end_ms"] = self.first.elapsed_time(end)

    def start_profile(self):
        from torch.profiler import ProfilerActivity, profile

        try:
            self.prof = profile(activities=[ProfilerActivity.CUDA if self.cuda else ProfilerActivity.CPU])
            self.prof.start()
            self.window = []
            self.profile["first_step"] = len(self.steps)
        except Exception as e:  # noqa: BLE001 - recorded; the step timings go on without it
            self.profile["error"] = f"{type(e).__name__}: {e}"
            self.prof = False

    def stop_profile(self):
        import torch

        try:
            if self.cuda:
                torch.cuda.synchronize()
            self.prof.stop()
            self.profile.update(self.summarize_profile(self.prof, self.window))
        except Exception as e:  # noqa: BLE001
            self.profile["error"] = f"{type(e).__name__}: {e}"
        self.window = None

    def summarize_profile(self, prof, window) -> dict:
        """The union of the device's activity over the window's wall time, and within each
        step's wall interval (kineto's timestamps are the host's wall clock in ns)."""
        import torch

        kind = torch.autograd.DeviceType.CUDA if self.cuda else torch.autograd.DeviceType.CPU
        spans = [(e.start_ns(), e.start_ns() + e.duration_ns()) for e in prof.profiler.kineto_results.events()
                 if e.device_type() == kind and e.duration_ns() > 0]
        start, end = window[0][0], window[-1][1]
        inside = [(max(a, start), min(b, end)) for a, b in spans if b > start and a < end]
        per_step = [union_ns([(max(a, s0), min(b, s1)) for a, b in inside if b > s0 and a < s1]) for s0, s1 in window]
        return {"steps": len(window), "activities": "cuda" if self.cuda else "cpu", "events": len(spans),
                "wall_ns": end - start, "busy_ns": union_ns(inside), "per_step_busy_ns": per_step}

    def dump(self):
        with self.lock:
            if self.cuda:
                self.drain(block=True)
            counts = getattr(self.executor, "graph_counts", None)
            pieces = getattr(getattr(self.executor, "runner", None), "pieces", None)
            data = {"hooked": self.hooked, "cuda": self.cuda, "go_step": self.go_step, "steps": self.steps,
                    "profile": self.profile, "profile_at": PROFILE_AT, "profile_steps": PROFILE_STEPS,
                    "graphs": dict(zip(("replays", "eager"), counts())) if counts else None,
                    "pieces": {"buckets": sorted(pieces.buckets), "dropped": sorted(pieces.dropped)}
                    if pieces is not None else None}
        tmp = self.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, self.out)

    def watch(self):
        go, trigger = Path(f"{self.out}.go"), Path(f"{self.out}.dump")
        while True:
            if self.go_step is None and go.exists():
                with self.lock:
                    self.go_step = len(self.steps)
            if trigger.exists():
                try:
                    self.dump()
                except Exception as e:  # noqa: BLE001 - say so in the file the caller waits for
                    self.out.write_text(json.dumps({"error": f"{type(e).__name__}: {e}"}))
                trigger.unlink(missing_ok=True)
            time.sleep(0.1)


def install(out: Path) -> StepClock:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from pagedserve.executor import Executor

    # kineto registers itself on its first use: here, on the main thread, not the model thread
    with profile(activities=[ProfilerActivity.CPU]):
        torch.zeros(1)
    clock = StepClock(out)
    name = "launch" if callable(getattr(Executor, "launch", None)) else "execute"
    setattr(Executor, name, clock.wrap(getattr(Executor, name)))
    clock.hooked = f"Executor.{name}"
    threading.Thread(target=clock.watch, daemon=True, name="steady-hook").start()
    return clock


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    install(Path(os.environ["STEADY_HOOK_OUT"]))
    from pagedserve.cli import main

    sys.exit(main(sys.argv[1:]))
