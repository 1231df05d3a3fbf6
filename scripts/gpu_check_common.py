"""What gpu_check.py and its part modules share, with nothing beyond the standard library:
ROOT (the repository), child_env(), the environment of every process a part starts, and
parsed_without_cuda(), a CUDA part's stand-in where there is no GPU."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def child_env() -> dict:
    """The environment of a child process: the repository ahead of any PYTHONPATH already
    set, which stays (wheels installed with `pip --target` must remain importable)."""
    old = os.environ.get("PYTHONPATH")
    return dict(os.environ, PYTHONPATH=str(ROOT) + (os.pathsep + old if old else ""))


PARSE_ALL = """
import json, sys
from pagedserve.cli import build_parser
for name, argv in json.loads(sys.argv[1]).items():
    try:
        build_parser().parse_args(argv)
    except SystemExit as e:
        sys.exit(f"{name}: {' '.join(argv)}: exit {e.code}")
"""


def parsed_without_cuda(part, commands: dict[str, list[str]]) -> dict:
    """No CUDA: the commands a part would run (`pagedserve` argv by name) parse, in a process
    of its own, so the CLI and every module it imports load in this environment; the runs
    themselves need the GPU. Recorded as the part's `arguments`; skipped, or failed where
    one does not parse."""
    done = subprocess.run([sys.executable, "-c", PARSE_ALL, json.dumps(commands)], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=120)
    part.put("arguments", {"commands": list(commands), "parsed": done.returncode == 0,
                           **({} if done.returncode == 0 else {"error": done.stderr[-1500:]})})
    return {"status": "skipped" if done.returncode == 0 else "failed", "reason": "no CUDA"}
