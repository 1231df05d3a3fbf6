"""bench throughput --busy-cores: the spinning neighbours run during the block and are gone after it."""
from pagedserve.benchmarks.busy_cores import busy_cores


def test_spinners_run_inside_the_block_only():
    with busy_cores(2) as procs:
        assert len(procs) == 2 and all(p.poll() is None for p in procs)
    assert all(p.returncode is not None for p in procs)
    with busy_cores(0) as none:
        assert none == []
