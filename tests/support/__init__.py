"""Helpers shared by the tests (not tests themselves): fake executors, process launchers,
the gateway harness, tiny models and the one health probe. ROOT is the repository root."""
from __future__ import annotations

from pathlib import Path


def _repo_root() -> Path:
    here = Path(__file__).resolve().parent
    for folder in (here, *here.parents):
        if (folder / "pyproject.toml").is_file():
            return folder
    raise RuntimeError(f"no pyproject.toml above {here}")


REPO = _repo_root()
ROOT = str(REPO)
