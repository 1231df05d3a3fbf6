"""`pagedserve memsvc|executor` flags: defaults, PAGEDSERVE_* fallbacks, help text."""
import argparse

import pytest

from memsvc.server import config_from_args
from pagedserve import service_cmds


def parse(argv):
    parser = argparse.ArgumentParser(prog="pagedserve")
    service_cmds.add_parsers(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_defaults_listen_on_loopback():
    m = parse(["memsvc"])
    assert (m.host, m.port, m.policy, m.session_lease, m.kv_tokens) == ("127.0.0.1", 50052, "paged", 10.0, None)
    e = parse(["executor"])
    assert (e.host, e.port, e.memsvc, e.block_size, e.dtype) == ("127.0.0.1", 50053, "127.0.0.1:50052", 16, "float32")
    assert callable(m.run) and callable(e.run)


def test_environment_fills_in_what_flags_leave_out(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_MEMSVC_PORT", "6000")
    monkeypatch.setenv("PAGEDSERVE_KV_TOKENS", "4096")
    monkeypatch.setenv("PAGEDSERVE_NO_PREFIX_CACHING", "1")
    monkeypatch.setenv("PAGEDSERVE_SESSION_LEASE", "2.5")
    monkeypatch.setenv("PAGEDSERVE_MEMSVC", "10.0.0.5:6000")
    m = parse(["memsvc", "--policy", "contiguous-max"])
    assert (m.port, m.kv_tokens, m.no_prefix_caching, m.session_lease) == (6000, 4096, True, 2.5)
    config = config_from_args(m)
    assert config.shared and config.kv_tokens == 4096 and not config.enable_prefix_caching
    assert config.policy == "contiguous-max" and config.session_lease_s == 2.5
    assert parse(["memsvc", "--port", "7"]).port == 7
    assert parse(["executor"]).memsvc == "10.0.0.5:6000"


def test_kv_size_flags_exclude_each_other(capsys):
    with pytest.raises(SystemExit):
        parse(["memsvc", "--kv-tokens", "10", "--kv-memory", "1"])
    assert "not allowed with" in capsys.readouterr().err


def test_help_names_the_environment_variables(capsys):
    with pytest.raises(SystemExit):
        parse(["executor", "--help"])
    out = capsys.readouterr().out
    assert "PAGEDSERVE_MEMSVC" in out and "--register-timeout" in out
