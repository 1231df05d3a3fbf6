"""Other processes that hold cores busy while a benchmark runs: a neighbour's load, to measure
how the engine holds up when it does not have the machine to itself."""
from __future__ import annotations

import contextlib
import subprocess
import sys

SPIN = "while True: pass"


@contextlib.contextmanager
def busy_cores(n: int):
    """`n` spinning processes for the duration of the block (none for 0)."""
    procs = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(n)]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def add_busy_cores_arg(parser) -> None:
    parser.add_argument("--busy-cores", type=int, default=0, metavar="N",
                        help="keep N other processes spinning during the timed runs (each holds "
                             "one core busy, as a neighbour would): how the engine holds up on a "
                             "machine it does not have to itself")
