"""The simulated accelerator: zero-cost outputs after a modeled step time, on a device that
runs a step launched early after the one before it (here on a fake clock: nothing slept)."""
import pytest

from pagedserve.executor.config import ExecutorConfig
from pagedserve.executor.simulated import GPUS, SHAPES, SimulatedExecutor, parse_spec
from pagedserve.executor.zero_cost import ZeroCostExecutor
from pagedserve.step.step_batch import StepBatch, empty_batch
from pagedserve.step.whole_seqs import Seq, batch_of
from pagedserve.wire.protocol import SamplingParams
from pagedserve.wire.settings import to_argv

SP = SamplingParams()
BS = 16


def table(tokens: int) -> list[int]:
    return [0] * -(-tokens // BS)  # the roofline reads no table: every block is block 0


def decode(batch: int, context: int) -> StepBatch:
    return batch_of([Seq(f"s{i}", [7], context - 1, table(context), True, SP, 1) for i in range(batch)], BS)


def prefill(tokens: int) -> StepBatch:
    return batch_of([Seq("p", list(range(tokens)), 0, table(tokens), True, SP, 1)], BS)


class FakeClock:
    def __init__(self):
        self.now, self.slept = 100.0, []

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.slept.append(seconds)
        self.now += seconds


def simulated(**kw) -> tuple[SimulatedExecutor, FakeClock]:
    clock = FakeClock()
    return SimulatedExecutor(sleep=clock.sleep, clock=clock, **kw), clock


def test_roofline_is_positive_and_grows_with_tokens_and_context():
    r = parse_spec("llama-8b@h200")
    base = r.step_seconds(decode(1, 100))
    assert base > 0
    assert r.step_seconds(decode(256, 100)) > base
    assert r.step_seconds(decode(256, 4000)) > r.step_seconds(decode(256, 100))
    assert r.step_seconds(prefill(8192)) > r.step_seconds(prefill(512))  # compute bound


def test_bigger_model_and_slower_gpu_take_longer():
    batch = decode(64, 500)
    assert parse_spec("llama-70b@h200").step_seconds(batch) > parse_spec("llama-8b@h200").step_seconds(batch)
    assert parse_spec("llama-8b@l40s").step_seconds(batch) > parse_spec("llama-8b@h200").step_seconds(batch)


def test_every_shape_and_gpu_parses():
    for shape in SHAPES:
        for gpu in GPUS:
            assert parse_spec(f"{shape}@{gpu}").step_seconds(decode(4, 10)) > 0
    assert parse_spec(" Llama-8B@H200 ") == parse_spec("llama-8b@h200")


@pytest.mark.parametrize("spec", ["llama-9b@h200", "llama-8b@tpu", "llama-8b", "h200"])
def test_bad_spec_names_the_choices(spec):
    with pytest.raises(ValueError) as e:
        parse_spec(spec)
    assert "--simulate" in str(e.value) and "llama-8b" in str(e.value) and "h200" in str(e.value)


def test_step_ms_is_slept_and_counted():
    ex, clock = simulated(step_ms=10.0)
    ex.execute(decode(3, 5))
    ex.execute(decode(2, 6))
    assert clock.slept == pytest.approx([0.01, 0.01])
    assert ex.simulated_seconds == pytest.approx(0.02) and ex.num_steps == 2


def test_roofline_time_is_what_is_slept():
    ex, clock = simulated(spec="llama-1b@h200")
    batch = decode(8, 50)
    ex.execute(batch)
    assert clock.slept == pytest.approx([ex.roofline.step_seconds(batch)])
    assert ex.simulated_seconds == ex.roofline.step_seconds(batch)


def test_a_step_launched_while_one_runs_starts_when_it_ends():
    ex, clock = simulated(step_ms=10.0)
    first = ex.launch(decode(2, 5))
    clock.now += 0.004  # the host launches the next step 4 ms into the first
    second = ex.launch(decode(2, 6))
    assert first.ends_at == pytest.approx(100.01) and second.ends_at == pytest.approx(100.02)
    assert second.outputs == first.outputs and second.seconds == pytest.approx(0.01)
    clock.now = 100.05  # idle for 30 ms: the next step starts when launched
    assert ex.launch(decode(2, 7)).ends_at == pytest.approx(100.06)
    assert ex.simulated_seconds == pytest.approx(0.03)  # the idle time is not busy time


def test_empty_step_sleeps_nothing():
    ex, clock = simulated(step_ms=5.0)
    assert ex.execute(empty_batch()) == [] and clock.slept == [] and ex.simulated_seconds == 0


def test_outputs_and_geometry_equal_zero_cost():
    batch = batch_of([Seq("a", [1, 2], 0, [0], True, SP, 1),
                      Seq("b", [3], 0, [1], False, SP, 1),
                      Seq("c", [4], 9, [0], True, SP, 1)], BS)
    sim = SimulatedExecutor(16, 4096, spec="llama-8b@h100", sleep=lambda s: None, clock=lambda: 0.0)
    zero = ZeroCostExecutor(16, 4096)
    assert sim.execute(batch) == zero.execute(batch)
    assert sim.model_info().kv == zero.model_info().kv
    assert sim.model_info().max_model_len == 4096


def test_takes_exactly_one_of_spec_and_step_ms():
    with pytest.raises(ValueError):
        SimulatedExecutor()
    with pytest.raises(ValueError):
        SimulatedExecutor(spec="llama-8b@h200", step_ms=1.0)


def test_config_validation():
    assert ExecutorConfig(simulate="llama-8b@h200").model_free
    assert ExecutorConfig(simulate_step_ms=2.5).simulated
    assert not ExecutorConfig().model_free and ExecutorConfig(zero_cost=True).model_free
    assert ExecutorConfig(zero_cost=True, simulate="llama-1b@h200").simulated  # redundant, allowed
    with pytest.raises(ValueError, match="--simulate-step-ms must be positive"):
        ExecutorConfig(simulate_step_ms=0)
    both = ExecutorConfig(simulate="llama-8b@h200", simulate_step_ms=1.0)  # the fixed time wins
    assert both.simulated and both.simulate_step_ms == 1.0
    with pytest.raises(ValueError, match="llama-70b"):
        ExecutorConfig(simulate="gpt-4@h200")


def test_simulate_flags_round_trip():
    argv = to_argv(ExecutorConfig(simulate="llama-8b@h200"))
    assert argv[argv.index("--simulate") + 1] == "llama-8b@h200"
    argv = to_argv(ExecutorConfig(simulate_step_ms=10.0))
    assert argv[argv.index("--simulate-step-ms") + 1] == "10.0"


def test_simulated_seconds_in_metrics():
    from prometheus_client import generate_latest

    from pagedserve.executor.metrics import ExecutorMetrics, SimulatedSeconds

    metrics, (ex, _) = ExecutorMetrics(), simulated(step_ms=250.0)
    SimulatedSeconds(ex, metrics.registry)
    ex.execute(decode(1, 1))
    assert "pagedserve:execute_simulated_seconds_total 0.25" in generate_latest(metrics.registry).decode()
