"""What gpu_check.py and its part modules share, with nothing beyond the standard library:
ROOT (the repository) and child_env(), the environment of every process a part starts."""
from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def child_env() -> dict:
    """The environment of a child process: the repository ahead of any PYTHONPATH already
    set, which stays (wheels installed with `pip --target` must remain importable)."""
    old = os.environ.get("PYTHONPATH")
    return dict(os.environ, PYTHONPATH=str(ROOT) + (os.pathsep + old if old else ""))
