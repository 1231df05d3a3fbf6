"""pagedserve.rpc.sent: the step clients' Futures: a Sent call is read once, by the first thread that asks, and is not
done before; its error is kept and raised to every asker; call_now's is done at once."""
from concurrent.futures import Future

import pytest

from pagedserve.rpc.sent import Sent, call_now


def test_a_sent_call_is_read_once_when_first_asked_and_keeps_its_answer():
    reads, ended = [], []
    future = Sent(lambda: reads.append(1) or "answer")
    future.add_done_callback(lambda f: ended.append(f.result()))
    assert isinstance(future, Future) and not future.done() and reads == []
    assert future.result() == "answer" and future.result() == "answer" and future.exception() is None
    assert reads == [1] and ended == ["answer"] and future.done()
    future.add_done_callback(lambda f: ended.append("late"))  # done: called at once
    assert ended == ["answer", "late"]


def test_a_sent_calls_error_is_raised_to_every_asker():
    def fail():
        raise KeyError("gone")

    future = Sent(fail)
    assert isinstance(future.exception(), KeyError)
    for _ in range(2):
        with pytest.raises(KeyError, match="gone"):
            future.result()


def test_call_now_makes_the_call_when_sent():
    calls = []
    future = call_now(lambda x: calls.append(x) or x * 2, 21)
    assert calls == [21] and future.done() and future.result() == 42
    failed = call_now(int, "x")
    assert failed.done() and isinstance(failed.exception(), ValueError)
