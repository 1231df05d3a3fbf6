"""A pagedserve module as it was at a git revision, for a benchmark that times it beside the
working tree's (scripts/bench_decode_cpu.py, scripts/bench_linear_cpu.py --baseline-rev).

module_at(rev, path) -> the namespace of `path` (relative to the repository root) read from git
at `rev` and executed; SystemExit naming the revision where git has no such file there.
"""
from __future__ import annotations

import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def module_at(rev: str, path: str) -> dict:
    shown = subprocess.run(["git", "-C", ROOT, "show", f"{rev}:{path}"], capture_output=True, text=True)
    if shown.returncode:
        raise SystemExit(f"--baseline-rev {rev}: git has no {path} there ({shown.stderr.strip()}); "
                         "name a commit that has it")
    module = {"__name__": f"{os.path.basename(path)}@{rev}"}
    exec(compile(shown.stdout, f"{rev}:{path}", "exec"), module)
    return module
