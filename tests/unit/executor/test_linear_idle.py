"""pagedserve.executor.linear_idle: the share of this process's CPUs other work took, from /proc/stat
(fake readings and a fake clock here), and when a timing counts as idle."""
import os
from types import SimpleNamespace

from pagedserve.executor import linear_idle

STAT = """cpu  900 9 90 5000 5 0 9 9 0 0
cpu0 100 1 10 2000 2 0 1 1 0 0
cpu1 800 8 80 3000 3 0 8 8 0 0
intr 1 2 3
"""


def test_busy_seconds_counts_the_given_cpus_busy_fields():
    tick = os.sysconf("SC_CLK_TCK")
    assert linear_idle.busy_seconds(STAT, {1}) == (800 + 8 + 80 + 8 + 8) / tick  # not idle, iowait
    assert linear_idle.busy_seconds(STAT, {0, 1}) == (113 + 904) / tick
    assert linear_idle.busy_seconds(STAT, {5}) == 0


def watch(monkeypatch, busy, own, wall, cpus=2):
    """An OtherWork whose readings come from the lists given (before, after)."""
    busy, own, wall = iter(busy), iter(own), iter(wall)
    monkeypatch.setattr(linear_idle, "_cpus", lambda: set(range(cpus)))
    monkeypatch.setattr(linear_idle, "_read_busy", lambda cpus: next(busy))
    monkeypatch.setattr(linear_idle, "time", SimpleNamespace(process_time=lambda: next(own),
                                                             perf_counter=lambda: next(wall)))
    return linear_idle.OtherWork()


def test_other_work_is_busy_time_less_this_process(monkeypatch):
    # 2 CPUs for 1 s: 1.6 s busy, 0.6 s of it this process's: others took 1.0 s of 2
    assert watch(monkeypatch, [10.0, 11.6], [5.0, 5.6], [100.0, 101.0]).share() == 0.5
    assert watch(monkeypatch, [10.0, 10.5], [5.0, 5.6], [100.0, 101.0]).share() == 0.0  # ticks lag


def test_no_share_from_a_short_watch_or_without_proc_stat(monkeypatch):
    assert watch(monkeypatch, [10.0, 11.0], [0.0, 0.0], [0.0, linear_idle.MIN_WATCH_S / 2]).share() is None
    assert watch(monkeypatch, [None, None], [0.0, 0.0], [0.0, 1.0]).share() is None


def test_this_machines_proc_stat_reads():
    if os.path.exists(linear_idle.STAT):
        assert linear_idle._read_busy(linear_idle._cpus()) > 0


def test_why_busy_names_the_measure_over_its_limit():
    assert linear_idle.why_busy(None, 1.0) is None
    assert linear_idle.why_busy(linear_idle.OTHERS_LIMIT, linear_idle.SPREAD_LIMIT) is None
    assert "other work took 30%" in linear_idle.why_busy(0.3, 1.0)
    assert "rounds differed by 2.00x" in linear_idle.why_busy(0.0, 2.0)
