"""pagedserve/huge_pages.py: THP_MEM_ALLOC_ENABLE set only where it can still take effect and
was not set by the user; the command line's entry asks before anything else."""
import sys

import pytest

from pagedserve import cli, huge_pages


def test_set_when_torch_is_not_imported_yet(monkeypatch):
    monkeypatch.delenv(huge_pages.VARIABLE, raising=False)
    monkeypatch.delitem(sys.modules, "torch")
    assert huge_pages.ask() == "THP_MEM_ALLOC_ENABLE=1 set"
    assert huge_pages.os.environ[huge_pages.VARIABLE] == "1"


def test_too_late_once_torch_is_imported(monkeypatch):
    import torch  # noqa: F401

    monkeypatch.delenv(huge_pages.VARIABLE, raising=False)
    assert "torch was imported first" in huge_pages.ask()
    assert huge_pages.VARIABLE not in huge_pages.os.environ


def test_the_users_value_stands(monkeypatch):
    monkeypatch.setenv(huge_pages.VARIABLE, "0")
    monkeypatch.delitem(sys.modules, "torch")
    assert huge_pages.ask() == "THP_MEM_ALLOC_ENABLE=0 as set"
    assert huge_pages.os.environ[huge_pages.VARIABLE] == "0"


def test_the_command_line_asks_first(monkeypatch):
    asked = []
    monkeypatch.setattr(huge_pages, "ask", lambda: asked.append(1) or "")
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert asked == [1]
