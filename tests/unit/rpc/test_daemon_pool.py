"""pagedserve.rpc.daemon_pool: Futures like ThreadPoolExecutor's, on daemon threads (an exiting
process does not wait for them); a Future cancelled while queued never runs."""
import threading

import pytest

from pagedserve.rpc.daemon_pool import DaemonPool


def test_results_errors_and_cancelled_work():
    pool = DaemonPool(1, "test-pool")
    gate, ran = threading.Event(), []
    first = pool.submit(gate.wait, 10)
    queued = pool.submit(ran.append, "queued")
    failing = pool.submit(lambda: 1 / 0)
    assert queued.cancel() and not first.done()
    gate.set()
    assert first.result(10) is True
    with pytest.raises(ZeroDivisionError):
        failing.result(10)
    pool.shutdown(wait=True)
    assert ran == []


def test_workers_are_daemons_and_queued_work_runs_before_shutdown_ends():
    pool = DaemonPool(2, "test-pool")
    assert all(t.daemon and t.name.startswith("test-pool-") for t in pool._threads)
    futures = [pool.submit(pow, 2, k) for k in range(20)]
    pool.shutdown(wait=True)
    assert [f.result(0) for f in futures] == [2 ** k for k in range(20)]
