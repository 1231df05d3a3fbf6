"""pagedserve.executor.linear_timing: one row is timed with the weight evicted before every call (as a
decode step meets it), larger row counts warm; every backend is timed at every row count;
the timing reports how far its rounds spread and what other work took meanwhile."""
import pytest
import torch

from pagedserve.executor import linear_backend, linear_timing
from pagedserve.executor.linear import Linear

pytestmark = pytest.mark.skipif(
    linear_backend.onednn_unavailable(torch.device("cpu"), torch.float32) is not None,
    reason="no oneDNN in this torch build")


def test_rows_below_the_bound_are_timed_cold(monkeypatch):
    sweeps = []
    monkeypatch.setattr(linear_timing.Sweep, "__call__", lambda self: sweeps.append(1))
    seconds = linear_timing.time_shape(Linear(torch.randn(24, 16)), (1, 64)).seconds
    assert set(seconds) == {1, 64} and all(set(t) == set(linear_timing.TIMED) for t in seconds.values())
    assert all(s > 0 for t in seconds.values() for s in t.values())
    assert len(sweeps) == linear_timing.REPS * len(linear_timing.TIMED) * linear_timing.COLD_CALLS


def test_warm_rows_only_sweep_nothing(monkeypatch):
    def no_sweep(self):
        raise AssertionError("a sweep buffer made for warm rows")
    monkeypatch.setattr(linear_timing.Sweep, "__init__", no_sweep)
    assert set(linear_timing.time_shape(Linear(torch.randn(24, 16)), (64, 512)).seconds) == {64, 512}


def test_the_sweep_exceeds_the_last_level_cache(monkeypatch):
    monkeypatch.setattr(linear_timing, "last_level_cache_bytes", lambda: 1 << 20)
    assert linear_timing.Sweep().buffer.numel() * 4 == 2 << 20
    monkeypatch.setattr(linear_timing, "last_level_cache_bytes", lambda: None)
    assert linear_timing.Sweep().buffer.numel() * 4 == 2 * linear_timing.DEFAULT_LLC
    monkeypatch.setattr(linear_timing, "last_level_cache_bytes", lambda: 4 << 30)
    assert linear_timing.Sweep().buffer.numel() * 4 == linear_timing.MAX_SWEEP_BYTES


def test_the_timing_reports_its_spread_and_the_other_work(monkeypatch):
    rounds = iter([1.0, 2.0, 1.2, 0.9, 1.5, 2.0, 1.2, 0.9, 3.0, 2.0, 1.2, 0.9]
                  + [3.0, 1.0, 2.0, 1.1] * 3)  # mkl's at M=64: 1, 1.5, 3
    monkeypatch.setattr(linear_timing, "_warm", lambda layer, b, x, calls: next(rounds))
    monkeypatch.setattr(linear_timing.OtherWork, "share", lambda self: 0.4)
    timing = linear_timing.time_shape(Linear(torch.randn(24, 16)), (64, 512))
    assert linear_timing.timed_backends(Linear(torch.randn(24, 16))) == ("mkl", "onednn", "dot", "panel")
    assert timing.seconds == {64: {"mkl": 1.0, "onednn": 2.0, "dot": 1.2, "panel": 0.9},
                              512: {"mkl": 3.0, "onednn": 1.0, "dot": 2.0, "panel": 1.1}}
    assert timing.spread == 1.5 and timing.others == 0.4
    assert "40%" in timing.busy()
    assert linear_timing.Timing(timing.seconds, 1.4, 0.1).busy() is None
    assert "1.60x" in linear_timing.Timing(timing.seconds, 1.6, 0.1).busy()


def test_one_slow_round_and_cold_rounds_leave_the_spread_alone(monkeypatch):
    """The best of the rounds drops one slow round; a cold call at a few rows is noisy by design."""
    warm = iter([1.0, 1.0, 1.0, 1.0, 1.4, 1.0, 1.0, 1.0, 9.0, 1.0, 1.0, 1.0])  # mkl at M=64: 1, 1.4, 9
    cold = iter([1.0, 1.0, 1.0, 1.0, 5.0, 1.0, 5.0, 5.0, 5.0, 5.0, 1.0, 5.0])  # at M=1: 1, 5, 5
    monkeypatch.setattr(linear_timing, "_warm", lambda layer, b, x, calls: next(warm))
    monkeypatch.setattr(linear_timing, "_cold", lambda layer, b, x, sweep: next(cold))
    monkeypatch.setattr(linear_timing, "Sweep", lambda: None)
    timing = linear_timing.time_shape(Linear(torch.randn(24, 16)), (1, 64))
    assert timing.seconds[1] == {"mkl": 1.0, "onednn": 1.0, "dot": 1.0, "panel": 1.0} and timing.seconds[64]["mkl"] == 1.0
    assert timing.spread == pytest.approx(1.4)
