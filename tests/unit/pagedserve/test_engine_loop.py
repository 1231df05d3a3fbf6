"""The in-process engine's batching loop (pagedserve.engine.loop_settings): serial on a CPU,
where the forward pass takes every core; as configured (overlapped by default) on a GPU,
where the step runs on the device while the loop works. Outputs are the same either way
(tests/unit/gateway/test_overlap.py runs every workload through every loop)."""
from gateway.scheduler import SchedulerConfig
from pagedserve.engine import loop_settings


def test_a_cpu_engine_runs_the_serial_loop_whatever_is_configured():
    settings = loop_settings(SchedulerConfig(max_num_seqs=8), "cpu")
    assert settings.overlap is False and settings.max_num_seqs == 8


def test_a_gpu_engine_overlaps_unless_told_not_to():
    assert loop_settings(SchedulerConfig(), "cuda:0").overlap is True
    assert loop_settings(SchedulerConfig(), "cuda:0").plan_ahead is True
    assert loop_settings(SchedulerConfig(overlap=False), "cuda:1").overlap is False
