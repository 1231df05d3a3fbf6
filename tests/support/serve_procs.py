"""Start `pagedserve` commands as real processes on loopback for the serve tests; always stop them."""
from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time

from pagedserve.serve_cmd import free_port
from tests.support import ROOT

CLI = [sys.executable, "-m", "pagedserve.cli"]


def start(*args: str, stdout=None) -> subprocess.Popen:
    """`python -m pagedserve.cli ARGS` in its own process group."""
    return subprocess.Popen([*CLI, *args], cwd=ROOT, stdout=stdout, text=True, process_group=0)


def children(pid: int) -> list[int]:
    """Direct children of `pid` (Linux /proc)."""
    out = []
    for path in glob.glob(f"/proc/{pid}/task/*/children"):
        with open(path) as f:
            out += [int(p) for p in f.read().split()]
    return sorted(out)


def cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return f.read().split("\0")
    except FileNotFoundError:
        return []


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def segments(pids: list[int]) -> list[str]:
    return [p for pid in pids for p in glob.glob(f"/dev/shm/pagedserve-kv-{pid}-*")]


def stop(procs: list[subprocess.Popen], grace: float = 20.0) -> None:
    """SIGTERM each process group, then SIGKILL what is left after `grace` seconds."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
