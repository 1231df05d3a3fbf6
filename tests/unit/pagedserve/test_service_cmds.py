"""`pagedserve memsvc|executor|gateway` flags: defaults, PAGEDSERVE_* fallbacks, help text."""
import argparse

import pytest

from pagedserve import service_cmds


def parse(argv):
    parser = argparse.ArgumentParser(prog="pagedserve")
    service_cmds.add_parsers(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return service_cmds.config_from(argv[0], args)


def test_defaults_listen_on_loopback():
    m = parse(["memsvc"])
    assert (m.host, m.port, m.memory.policy, m.memory.session_lease, m.memory.kv_tokens) == ("127.0.0.1", 50052, "paged", 10.0, None)
    e = parse(["executor"])
    assert (e.host, e.port, e.memsvc, e.block_size, e.dtype, e.device) == (
        "127.0.0.1", 50053, "127.0.0.1:50052", 16, "auto", "auto")
    g = parse(["gateway"])
    assert (g.host, g.port, g.http_host, g.replica) == ("127.0.0.1", 50051, "127.0.0.1", [])


def test_environment_fills_in_what_flags_leave_out(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_MEMSVC_PORT", "6000")
    monkeypatch.setenv("PAGEDSERVE_KV_TOKENS", "4096")
    monkeypatch.setenv("PAGEDSERVE_PREFIX_CACHING", "0")
    monkeypatch.setenv("PAGEDSERVE_SESSION_LEASE", "2.5")
    monkeypatch.setenv("PAGEDSERVE_MEMSVC", "10.0.0.5:6000")
    monkeypatch.setenv("PAGEDSERVE_REPLICAS", "a:1,b:2 c:3,d:4")
    m = parse(["memsvc", "--policy", "contiguous-max"])
    assert (m.port, m.memory.kv_tokens, m.memory.prefix_caching, m.memory.session_lease) == (6000, 4096, False, 2.5)
    assert m.memory.policy == "contiguous-max"
    assert parse(["memsvc", "--port", "7"]).port == 7
    assert parse(["memsvc", "--prefix-caching"]).memory.prefix_caching
    assert parse(["executor"]).memsvc == "10.0.0.5:6000"
    assert parse(["gateway"]).replica_addresses() == [("a:1", "b:2"), ("c:3", "d:4")]
    assert parse(["gateway", "--replica", "e:5,f:6"]).replica == ["e:5,f:6"]


def test_kv_tokens_wins_over_kv_memory():
    m = parse(["memsvc", "--kv-tokens", "160", "--kv-memory", "1"])
    assert m.memory.kv_tokens == 160


@pytest.mark.parametrize("argv,word", [
    (["memsvc", "--kv-tokens", "0"], "--kv-tokens"),
    (["memsvc", "--swap-space", "-1"], "--swap-space"),
    (["executor", "--block-size", "0"], "--block-size"),
    (["gateway", "--max-waiting", "-1"], "--max-waiting"),
    (["gateway", "--replica", "only-one-address"], "--replica"),
])
def test_bad_settings_name_the_flag(argv, word):
    with pytest.raises(ValueError, match=word):
        parse(argv)


def test_a_bad_setting_exits_2_with_the_message(capsys):
    parser = argparse.ArgumentParser(prog="pagedserve")
    service_cmds.add_parsers(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["memsvc", "--kv-tokens", "-3"])
    assert args.run(args) == 2
    assert "--kv-tokens must be positive" in capsys.readouterr().err


def test_help_names_the_environment_variables(capsys):
    with pytest.raises(SystemExit):
        parse(["executor", "--help"])
    out = capsys.readouterr().out
    assert "PAGEDSERVE_MEMSVC" in out and "--register-timeout" in out


@pytest.mark.parametrize("service", ["memsvc", "executor"])
def test_a_service_with_neither_token_nor_mutual_tls_exits_2_unless_told_it_may_be_open(
        service, capsys, monkeypatch):
    monkeypatch.delenv("PAGEDSERVE_INTERNAL_TOKEN", raising=False)
    parser = argparse.ArgumentParser(prog="pagedserve")
    service_cmds.add_parsers(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args([service, "--port", "1"])
    assert args.run(args) == 2
    err = capsys.readouterr().err
    assert "--internal-token" in err and "--insecure-internal" in err and "PAGEDSERVE_INTERNAL_TOKEN" in err
    assert parse([service, "--insecure-internal"]).insecure_internal


def test_the_internal_token_comes_from_the_environment_and_a_bad_one_names_the_flag(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_INTERNAL_TOKEN", "a-token-from-a-kubernetes-secret")
    for service in ("memsvc", "executor", "gateway"):
        assert parse([service]).internal_token == "a-token-from-a-kubernetes-secret"
    monkeypatch.setenv("PAGEDSERVE_INTERNAL_TOKEN", "short")
    with pytest.raises(ValueError, match="--internal-token"):
        parse(["gateway"])


def test_help_does_not_print_a_secret_from_the_environment(capsys, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_INTERNAL_TOKEN", "do-not-print-this-token")
    monkeypatch.setenv("PAGEDSERVE_API_KEY", "do-not-print-this-key")
    with pytest.raises(SystemExit):
        parse(["gateway", "--help"])
    out = capsys.readouterr().out
    assert "do-not-print" not in out and "set, not shown" in out
