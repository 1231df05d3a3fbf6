"""gpu_check's tp part (scripts/gpu_check_tp.py, issue 29) without GPUs: it says it did not run
where there is no CUDA or fewer than 2 GPUs (and serve then gets its seconds); with 2 GPUs
mocked, its status follows NCCL's result and pagedserve's (a refusal fails it, naming why);
the bus bandwidth is NCCL tests' measure."""
import types

import pytest

from tests.support.gpu_check import load_gpu_check as load


def tp_module():
    load().runners(types.SimpleNamespace(device="cpu"), None)  # puts scripts/ on sys.path
    import gpu_check_tp

    return gpu_check_tp


def fake_part():
    return types.SimpleNamespace(put=lambda k, v: v, left=lambda: 20.0)


def test_bus_bandwidth_is_nccl_tests_measure():
    tp = tp_module()
    r = tp.bus_bandwidth(0.001, 10**9, world=2)
    assert r["algbw_gb_s"] == pytest.approx(1000.0) and r["busbw_gb_s"] == pytest.approx(1000.0)
    assert tp.bus_bandwidth(0.001, 10**9, world=8)["busbw_gb_s"] == pytest.approx(1750.0)


@pytest.mark.parametrize("cuda, gpus, words", [(False, 0, "no CUDA"), (True, 1, "fewer than 2 GPUs (1 visible)")])
def test_it_says_it_did_not_run(monkeypatch, cuda, gpus, words):
    tp = tp_module()
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(tp, "run_nccl", None)  # must not be reached
    result = tp.part_tp(None, fake_part(), None, None)
    assert result["status"] == "skipped"
    assert words in result["reason"] and "the tensor-parallel part did not run" in result["reason"]


@pytest.mark.parametrize("nccl_ok, pagedserve, status", [
    (True, {"ran": True, "greedy_equal": True}, "ok"),
    (False, {"ran": True, "greedy_equal": True}, "failed"),
    (True, {"ran": True, "greedy_equal": False}, "failed"),
    (True, {"ran": False, "refused": "runs on the CPU only so far"}, "failed"),
])
def test_with_two_gpus_the_status_follows_both_checks(monkeypatch, tmp_path, nccl_ok, pagedserve, status):
    tp = tp_module()
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(tp, "run_nccl", lambda work, timeout, env: {"ok": nccl_ok})
    monkeypatch.setattr(tp, "run_pagedserve", lambda model: pagedserve)
    result = tp.part_tp(None, fake_part(), tmp_path, lambda path, **kw: path)
    assert result["status"] == status
    if not pagedserve["ran"]:
        assert "refused 2 ranks" in result["reason"] and pagedserve["refused"] in result["reason"]


def test_serve_gets_the_seconds_of_a_tp_part_that_did_not_run(monkeypatch, tmp_path):
    gc = load()
    budgets = {}

    def fake_runners(args, work):
        def record(name, result):
            def run(part):
                budgets[name] = part.left()
                return result
            return run
        return {"tp": record("tp", {"status": "skipped", "reason": "fewer than 2 GPUs"}),
                "serve": record("serve", {"status": "ok"})}

    monkeypatch.setattr(gc, "runners", fake_runners)
    monkeypatch.setattr(gc, "environment", lambda args: {})
    monkeypatch.setattr(gc.signal, "signal", lambda *a: None)
    assert gc.main(["--out", str(tmp_path / "c.json"), "--parts", "tp,serve"]) == 0
    assert budgets["serve"] > gc.DEFAULT_BUDGETS["serve"] + gc.DEFAULT_BUDGETS["tp"] - 5
    assert budgets["tp"] <= gc.DEFAULT_BUDGETS["tp"]
