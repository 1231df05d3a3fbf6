"""pagedserve.gateway.step_runner: --max-waiting counts sequences, not requests: each of a request's n
samples (held for their fork or queued) and the beams a beam search will fork."""
import pytest

from pagedserve.gateway.request_intake import RequestError
from pagedserve.gateway.step_runner import QueueFull, StepRunner, waiting_sequences
from pagedserve.wire.protocol import SamplingParams
from tests.support.fake_loop import make_loop


def idle_runner(max_waiting: int) -> StepRunner:
    """A runner whose loop never steps (its worker is stopped): what is queued stays waiting,
    and the test applies the commands itself."""
    loop, _, _ = make_loop(max_model_len=256)
    runner = StepRunner(loop, max_waiting=max_waiting)
    runner.stop()
    return runner


def submit(runner: StepRunner, request_id: str, prompt=(1, 2, 3, 4), **sampling):
    done = runner.submit(request_id, list(prompt), SamplingParams(max_tokens=4, **sampling), lambda item: None)
    runner._apply_commands()
    return done.exception(timeout=0)


def test_each_of_n_counts_against_max_waiting():
    runner = idle_runner(8)
    assert submit(runner, "a", n=4) is None
    assert waiting_sequences(runner.loop.scheduler) == 4  # one queued, three held for the fork
    assert submit(runner, "b", n=3) is None
    assert isinstance(submit(runner, "c", n=2), QueueFull)  # 7 + 2 > 8
    assert submit(runner, "d", n=1) is None  # 7 + 1 fits
    error = submit(runner, "e")
    assert isinstance(error, QueueFull) and "8 sequences waiting" in str(error) and "--max-waiting" in str(error)


def test_samples_queued_without_a_fork_count_too():
    runner = idle_runner(4)
    assert submit(runner, "a", prompt=(5,), n=3) is None  # a one-token prompt: nothing to share
    assert len(runner.loop.scheduler.waiting) == 3 and waiting_sequences(runner.loop.scheduler) == 3
    assert isinstance(submit(runner, "b", n=2), QueueFull)


def test_a_beam_search_counts_its_width():
    runner = idle_runner(6)
    assert submit(runner, "a", beam_width=4, temperature=0.0) is None
    assert waiting_sequences(runner.loop.scheduler) == 4
    assert isinstance(submit(runner, "b", beam_width=3, temperature=0.0), QueueFull)
    assert submit(runner, "c", n=2) is None


def test_more_sequences_than_the_bound_alone_is_a_request_error():
    runner = idle_runner(4)
    error = submit(runner, "a", n=5)
    assert isinstance(error, RequestError) and "n=5" in str(error) and "--max-waiting 4" in str(error)
    assert not runner.loop.scheduler.waiting


def test_no_bound_admits_any_number():
    runner = idle_runner(0)
    for k in range(5):
        assert submit(runner, f"r{k}", n=16) is None
    assert waiting_sequences(runner.loop.scheduler) == 80


@pytest.mark.parametrize("n", [1, 2])
def test_the_count_drops_when_a_request_is_aborted(n):
    runner = idle_runner(2)
    assert submit(runner, "a", n=n) is None
    runner.abort("a")
    runner._apply_commands()
    assert waiting_sequences(runner.loop.scheduler) == 0
    assert submit(runner, "b", n=2) is None
