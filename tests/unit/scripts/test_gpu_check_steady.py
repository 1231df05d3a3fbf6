"""gpu_check's steady part without a GPU or a process: the bytes its roofline counts for the
issue's shapes (issue 42's figures: 2.08 GB of weights and 32 KiB of K/V a token at 1.1B),
the executor hook's records of a fake executor's steps (shapes, the profiled window, the dump
on a trigger file), the figures made of them, the settings (>= 1,000 requests on a GPU) and
the session script's budget. The whole part on the CPU (real services, transformers'
continuous batching): tests/system/test_gpu_check_steady_serve.py."""
from __future__ import annotations

import re
import time

import pytest

from pagedserve.executor.step_merger import Launched
from pagedserve.wire.pending_outputs import PendingOutputs
from pagedserve.step.whole_seqs import Seq, batch_of
from tests.support.gpu_check import SCRIPTS, load_gpu_check, load_part

steady = load_part("gpu_check_steady")
hook = load_part("gpu_check_steady_hook")
report = load_part("gpu_check_steady_report")
models = load_part("gpu_check_models")


def sizes_of(name):
    g = steady.SHAPES[name]
    model = models.random_llama(hidden=g["hidden"], layers=g["layers"], heads=g["heads"], kv_heads=g["kv_heads"],
                                inter=g["inter"], vocab=g["vocab"], device="meta")
    return report.model_bytes([(n, p.numel()) for n, p in model.named_parameters()], 2, g["layers"],
                              g["kv_heads"], g["hidden"] // g["heads"])


def test_the_roofline_counts_the_issues_bytes():
    small, big = sizes_of("1.1B"), sizes_of("8B")
    assert small["kv_bytes_per_token"] == 32 * 1024 and big["kv_bytes_per_token"] == 128 * 1024
    assert small["weight_bytes"] == pytest.approx(2.08e9, rel=0.01)  # all but the input embedding
    assert big["weight_bytes"] == pytest.approx(2 * (8.03e9 - 128256 * 4096), rel=0.01)
    # issue 42: batch 64 at a mean context of ~460 reads ~3.05 GB, 0.72 ms at 4.24 TB/s
    step = {"context": 64 * 460}
    assert report.roofline_ms(step, small, 4240) == pytest.approx(0.72, rel=0.03)


def test_union_counts_overlaps_once():
    assert hook.union_ns([]) == 0
    assert hook.union_ns([(0, 10), (5, 20), (30, 40), (32, 35)]) == 30
    assert hook.union_ns([(5, 6), (0, 100)]) == 100


def step(*seqs):
    """A StepBatch of (tokens, start) pairs, each with a table that holds it."""
    return batch_of([Seq(f"s{i}", tokens, start, list(range(4))) for i, (tokens, start) in enumerate(seqs)], 16)


def test_batch_shape_reads_decodes_and_contexts():
    decode = step(([1], 9), ([2], 19))
    assert hook.batch_shape(decode) == {"seqs": 2, "tokens": 2, "decode": True, "context": 30}
    mixed = step(([1], 9), ([1, 2, 3], 0))
    assert hook.batch_shape(mixed) == {"seqs": 2, "tokens": 4, "decode": False, "context": 13}
    assert hook.batch_shape(object())["seqs"] is None  # another batch type: recorded, not judged


class FakeExecutor:
    runner = type("Runner", (), {"pieces": type("Pieces", (), {"buckets": {16: 0, 32: 0}, "dropped": {48}})})

    def execute(self, batch):
        import torch

        torch.ones(64, 64) @ torch.ones(64, 64)  # an operator for the (CPU) profiler to see
        if batch.num_seqs == 2 and batch.start_pos[0] == 17:  # as a GPU's launch: outputs on their way
            return Launched(PendingOutputs(None, 0, 2))
        return [batch.num_seqs]

    def graph_counts(self):
        return 7, 2


def test_the_hook_records_steps_profiles_a_window_and_dumps_on_request(tmp_path, monkeypatch):
    monkeypatch.setattr(hook, "PROFILE_AT", 2)
    monkeypatch.setattr(hook, "PROFILE_STEPS", 3)
    clock = hook.StepClock(tmp_path / "hook.json")
    clock.hooked = "FakeExecutor.execute"
    execute = clock.wrap(FakeExecutor.execute)
    ex = FakeExecutor()
    start = time.time()
    assert execute(ex, step(([1, 2], 0))) == [1]  # before FILE.go: not profiled
    clock.go_step = len(clock.steps)
    for n in range(8):
        execute(ex, step(([1], 10 + n), ([1], 20 + n)))
    end = time.time()
    clock.dump()
    import json

    data = json.loads((tmp_path / "hook.json").read_text())
    assert data["cuda"] is False and len(data["steps"]) == 9
    prof = data["profile"]
    assert prof["first_step"] == 1 + 2 and prof["steps"] == 3 and len(prof["per_step_busy_ns"]) == 3
    assert 0 < prof["busy_ns"] <= prof["wall_ns"]
    sizes = {"weight_bytes": 1000, "kv_bytes_per_token": 10}
    figures = report.step_figures(data, start, end, sizes, copy_gb_per_s=1.0)
    assert figures["steps"] == 9 and figures["decode_steps"] == 8 and figures["max_seqs"] == 2
    assert figures["clock"].startswith("host") and 0 < figures["host_in_steps_share"] <= 1
    assert figures["decode"]["steps"] == 8 and set(figures["decode"]["by_batch"]) == {"2-8"}
    assert figures["decode"]["median_roofline_ms"] == pytest.approx((1000 + 10 * (10 + 3 + 20 + 4 + 2)) / 1e6,
                                                                     rel=0.05)
    assert figures["profile"]["steps"] == 3 and 0 < figures["profile"]["busy_share"] <= 1
    assert figures["graphs"] == {"replays": 7, "eager": 2}  # the executor's own counts, as it reports them
    assert figures["pending_steps"] == 1
    line = report.one_line("x", {"steps": figures, "num_requests": 9})
    assert "steady x:" in line and "CUDA graphs 7 steps replayed, 2 eager;" in line
    assert "1 of 9 steps launched with outputs pending;" in line
    assert data["pieces"] == {"buckets": [16, 32], "dropped": [48]}
    assert "piecewise buckets 2 captured, dropped [48];" in line


def test_the_watcher_dumps_when_asked(tmp_path):
    clock = hook.StepClock(tmp_path / "hook.json")
    clock.hooked = "x"
    import threading

    (tmp_path / "hook.json.go").touch()  # before the watcher looks: else it may see the dump first
    threading.Thread(target=clock.watch, daemon=True).start()
    data = steady.wait_for_dump(tmp_path / "hook.json", timeout=10)
    assert data["steps"] == [] and data["go_step"] == 0 and not (tmp_path / "hook.json.dump").exists()


def test_a_profile_that_never_ran_says_why():
    data = {"steps": [], "profile": {"steps": 0}, "cuda": True}
    assert report.profile_figures(data, {}, 1.0) == {"steps": 0, "reason": "the run ended first"}
    assert report.step_figures({"error": "no file"}, 0, 1, {}, 1.0) == {"error": "no file"}
    assert report.one_line("8B", {"error": "RuntimeError: boom"}).endswith("error: RuntimeError: boom")


def test_settings_on_a_gpu_and_in_the_rehearsal(tmp_path):
    gpu = steady.options(False, "cuda", tmp_path)
    assert gpu.shapes == ["1.1B", "8B"] and gpu.num_requests >= 1000 and gpu.dtype == "bfloat16"
    assert gpu.max_total == 2048 and gpu.device == "cuda"
    cpu = steady.options(True, "cuda", tmp_path)
    assert cpu.device == "cpu" and cpu.num_requests == 20 and set(cpu.shapes) <= set(steady.SHAPES)
    assert sum(steady.SHARE[s] for s in gpu.shapes) == pytest.approx(1.0)


def test_the_session_gives_steady_its_budget_and_leaves_quick_its_time():
    gc = load_gpu_check()
    session = (SCRIPTS / "gpu_session.sh").read_text()
    seconds = int(re.search(r"^steady=(\d+)$", session, re.M).group(1))
    total = int(re.search(r"^total=(\d+)$", session, re.M).group(1))
    assert seconds == gc.DEFAULT_BUDGETS["steady"]
    assert total <= 600 - 30 and total - (seconds + 40) >= 172  # --quick took 172 s on the first H200
    assert "steady" not in gc.DEFAULT_PARTS and "steady" in gc.PARTS
