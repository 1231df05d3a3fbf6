"""The in-process engine's batching loop (pagedserve.engine.loop_settings): serial on a CPU,
where the forward pass takes every core; as configured (overlapped by default) on a GPU,
where the step runs on the device while the loop works. Outputs are the same either way
(tests/unit/gateway/test_overlap.py runs every workload through every loop)."""
from pagedserve.engine import loop_settings
from pagedserve.gateway.scheduler_config import SchedulerConfig


def test_a_cpu_engine_runs_the_serial_loop_whatever_is_configured():
    settings = loop_settings(SchedulerConfig(max_num_seqs=8), "cpu")
    assert settings.overlap is False and settings.max_num_seqs == 8


def test_a_gpu_engine_overlaps_unless_told_not_to():
    assert loop_settings(SchedulerConfig(), "cuda:0").overlap is True
    assert loop_settings(SchedulerConfig(), "cuda:0").plan_ahead is True
    assert loop_settings(SchedulerConfig(overlap=False), "cuda:1").overlap is False


def test_each_step_runs_with_the_engines_device_current(monkeypatch):
    """The overlapped loop calls execute from a helper thread; the engine makes its own GPU
    current around each step (pagedserve.pool_share.device.on_device), whatever thread calls."""
    import contextlib

    import torch

    import pagedserve.engine as engine

    entered = []

    @contextlib.contextmanager
    def on_device(device):
        entered.append(device)
        yield

    monkeypatch.setattr(engine, "on_device", on_device)

    class Executor:
        device = torch.device("cuda", 1)

        def execute(self, batch):
            assert entered == [self.device]
            return ["out"]

    assert engine._FixedInfo(Executor(), info=None).execute("batch") == ["out"]
    assert entered == [torch.device("cuda", 1)]
