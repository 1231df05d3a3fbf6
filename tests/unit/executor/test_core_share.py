"""The executor's thread count follows the cores other processes leave it (pagedserve.executor.core_share)."""
import os

from pagedserve.executor.core_share import FIXED_THREADS_ENV, CoreShare, busy_seconds


class Machine:
    """A fake clock and CPU counters: each window, this process and the others use given cores."""

    def __init__(self):
        self.now = self.busy = self.own = 0.0
        self.set = []

    def window(self, share: CoreShare, mine: float, others: float, seconds: float = 1.0) -> int:
        self.now += seconds
        self.own += mine * seconds
        self.busy += (mine + others) * seconds
        return share.adjust()


def share(machine: Machine, threads: int = 2) -> CoreShare:
    s = CoreShare(interval=0.5, clock=lambda: machine.now, busy=lambda: machine.busy,
                  own=lambda: machine.own, set_threads=machine.set.append, max_threads=threads)
    s.cores = 2
    return s


def test_a_core_taken_for_two_windows_drops_a_thread_and_its_return_restores_it():
    m = Machine()
    s = share(m)
    assert m.window(s, 2.0, 0.1) == 2 and m.set == []
    assert m.window(s, 1.3, 0.7) == 2  # one window: proposed only
    assert m.window(s, 1.3, 0.7) == 1 and m.set == [1]
    assert m.window(s, 1.0, 1.0) == 1
    assert m.window(s, 1.0, 0.05) == 1  # gone for one window
    assert m.window(s, 1.0, 0.05) == 2 and m.set == [1, 2] and s.changes == 2


def test_a_passing_load_changes_nothing():
    m = Machine()
    s = share(m)
    for others in (0.9, 0.1, 0.9, 0.2, 0.5, 0.55):
        assert m.window(s, 1.5, others) == 2
    assert m.set == []


def test_within_a_window_nothing_is_read():
    m = Machine()
    s = share(m)
    m.window(s, 1.0, 1.0, seconds=1.0)
    reads = []
    s.busy = lambda: reads.append(1) or m.busy
    m.window(s, 1.0, 1.0, seconds=0.2)
    assert reads == []


def test_never_below_one_nor_above_the_start():
    m = Machine()
    s = share(m, threads=1)
    for _ in range(3):
        assert m.window(s, 1.0, 0.0) == 1
    s2 = share(m, threads=2)
    assert [m.window(s2, 0.5, 2.0) for _ in range(3)] == [2, 1, 1]


def test_busy_seconds_counts_the_affinity_cores_with_steal(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  9 9 9 9 9 9 9 9 0 0\n"
                    "cpu0 100 1 10 500 7 2 3 4 0 0\n"
                    "cpu1 200 0 20 500 7 0 0 0 0 0\n"
                    "intr 1 2 3\n")
    tick = os.sysconf("SC_CLK_TCK")
    assert busy_seconds({0}, str(stat)) == (100 + 1 + 10 + 2 + 3 + 4) / tick
    assert busy_seconds({0, 1}, str(stat)) == (120 + 220) / tick


def test_the_real_counters_read(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv(FIXED_THREADS_ENV, raising=False)
    s = CoreShare.for_this_process()
    assert s is not None and s.adjust() == s.threads
    monkeypatch.setenv(FIXED_THREADS_ENV, "1")
    assert CoreShare.for_this_process() is None
