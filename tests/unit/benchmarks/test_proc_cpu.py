"""pagedserve.benchmarks.proc_cpu reads this process's own CPU time from /proc."""
import os
import time

from pagedserve.benchmarks.proc_cpu import cpu_seconds


def test_own_cpu_is_non_negative_and_grows_with_work():
    before = cpu_seconds()
    assert before >= 0
    end = time.process_time() + 0.05
    while time.process_time() < end:
        pass
    assert cpu_seconds() > before
    assert cpu_seconds(os.getpid()) >= before
