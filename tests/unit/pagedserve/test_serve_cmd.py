"""pagedserve.serve_cmd: every flag of every service works on `serve` and reaches its service."""
import dataclasses

import pytest

from pagedserve import service_cmds
from pagedserve.cli import build_parser
from pagedserve.executor.config import ExecutorConfig
from pagedserve.gateway.config import STOP_AFTER_DRAIN_S, GatewayConfig
from pagedserve.memsvc.config import MemsvcConfig
from pagedserve.serve_cmd import service_specs
from pagedserve.wire.settings import _kind, dest, flag_name, settings_of

SERVICES = {"memsvc": MemsvcConfig, "executor": ExecutorConfig, "gateway": GatewayConfig}


def odd_value(owner, f):
    """A value for the field that differs from its default and passes validation."""
    kind, is_list = _kind(owner, f)
    if f.metadata["choices"]:
        return next(c for c in reversed(f.metadata["choices"]) if c != f.default)
    if kind is bool:
        return not f.default
    if kind is int:
        return {"max_num_seqs": 24, "max_num_batched_tokens": 4096, "block_size": 32,
                "http_port": 18123, "metrics_port": 19123,
                "max_request_bytes": 8192}.get(dest(f), 37)
    if dest(f) == "kv_offload":  # needs paged + prefix caching, which the odd values turn off
        return f.default
    if kind is float:
        return {"gpu_memory_utilization": 0.75}.get(dest(f), 3.25)
    value = {"simulate": "llama-1b@h100"}.get(dest(f), f"/tmp/x-{dest(f)}")
    return [value, value + "-2"] if is_list else value


def service_settings():
    """(service, field's dest, value) for every non-wiring setting of every service."""
    for name, cls in SERVICES.items():
        for owner, f in settings_of(cls):
            if not f.metadata["wiring"]:
                yield name, owner, f


def serve_argv():
    argv, seen = ["serve", "--port", "7000"], set()
    for _, owner, f in service_settings():
        if dest(f) in seen:
            continue
        seen.add(dest(f))
        value = odd_value(owner, f)
        if isinstance(value, bool):
            argv.append(flag_name(f) if value else "--no-" + flag_name(f)[2:])
        elif isinstance(value, list):
            argv += [flag_name(f), *value] if f.metadata["several"] else [
                x for item in value for x in (flag_name(f), item)]
        else:
            argv += [flag_name(f), str(value)]
    return argv


def child_config(spec):
    """The config the child process builds from its command line."""
    argv = spec.argv[spec.argv.index("pagedserve.cli") + 1:]
    args = build_parser().parse_args(argv)
    return argv[0], service_cmds.config_from(argv[0], args)


def test_every_flag_of_every_service_reaches_that_service_through_serve(monkeypatch):
    specs = service_specs(build_parser().parse_args(serve_argv()))
    configs = {}
    for spec in specs:
        for key, value in spec.env.items():  # secrets travel by environment
            monkeypatch.setenv(key, value)
        configs[spec.name] = child_config(spec)
    assert [s.name for s in specs] == ["memsvc", "executor", "gateway"]
    checked = 0
    for service, owner, f in service_settings():
        _, config = configs[service]
        holder = config
        if owner is not type(config):
            holder = next(getattr(config, g.name) for g in dataclasses.fields(config)
                          if isinstance(getattr(config, g.name), owner))
        got = getattr(holder, f.name)
        want = odd_value(owner, f)
        if dest(f) == "metrics_port" and service != "gateway":
            # memsvc and the executor get free ones, scraped by the gateway's HTTP /metrics
            assert got and f"{service}=http://127.0.0.1:{got}/metrics" in configs["gateway"][1].metrics_upstream
            want = got
        if dest(f) == "drain_timeout" and service == "executor":
            want = 0.0  # the gateways drain; the executors are stopped only after them
        assert got == want, f"{service} {flag_name(f)}: {got!r} != {want!r}"
        checked += 1
    assert checked >= 40


def test_kv_offload_reaches_memsvc_through_serve():
    memsvc = service_specs(build_parser().parse_args(["serve", "--kv-offload", "1.5"]))[0]
    assert child_config(memsvc)[1].memory.kv_offload == 1.5


def test_wiring_points_the_services_at_each_other():
    specs = service_specs(build_parser().parse_args(["serve", "--port", "7100"]))
    memsvc, executor, gateway = (child_config(s)[1] for s in specs)
    assert executor.memsvc == f"127.0.0.1:{memsvc.port}"
    assert (gateway.memsvc, gateway.executor) == (f"127.0.0.1:{memsvc.port}", f"127.0.0.1:{executor.port}")
    assert gateway.port == 7100 and specs[-1].address == "127.0.0.1:7100"


def test_a_port_serve_draws_is_never_one_named_on_its_command_line(monkeypatch):
    """The named ports are free while serve draws the others (nothing binds them yet): every
    draw landing on one of them is refused, else a service could not bind (a health check that
    never answers)."""
    from pagedserve.rpc import ports

    named = [ports.free_port() for _ in range(4)]  # free ports, so a draw can land on them
    draws = iter(named * 3 + list(range(20000, 30000)))
    monkeypatch.setattr(ports._random, "choice", lambda spans: spans[0])
    monkeypatch.setattr(ports._random, "randint", lambda a, b: next(draws))
    monkeypatch.setattr(ports, "_given", set())
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (40000, 60999))
    gateway_port, memsvc_port, http_port, metrics_port = named
    specs = service_specs(build_parser().parse_args(
        ["serve", "--port", str(gateway_port), "--memsvc-port", str(memsvc_port),
         "--http-port", str(http_port), "--metrics-port", str(metrics_port)]))
    memsvc, executor, gateway = (child_config(s)[1] for s in specs)
    used = [memsvc.port, memsvc.metrics_port, executor.port, executor.metrics_port,
            gateway.port, gateway.http_port, gateway.metrics_port]
    assert len(set(used)) == len(used), used
    assert (gateway.port, memsvc.port, gateway.http_port, gateway.metrics_port) == tuple(named)


def test_the_api_key_travels_by_environment_not_on_the_command_line():
    gateway = service_specs(build_parser().parse_args(["serve", "--api-key", "s3cret"]))[-1]
    assert "s3cret" not in " ".join(gateway.argv)
    assert gateway.env["PAGEDSERVE_API_KEY"] == "s3cret"


def test_every_launch_makes_one_internal_token_for_all_its_children_by_environment(monkeypatch):
    monkeypatch.delenv("PAGEDSERVE_INTERNAL_TOKEN", raising=False)
    argv = ["serve", "--replicas", "2", "--gateways", "2"]
    specs = service_specs(build_parser().parse_args(argv))
    tokens = {s.env.get("PAGEDSERVE_INTERNAL_TOKEN") for s in specs}
    assert len(tokens) == 1 and None not in tokens
    [token] = tokens
    assert len(token) >= 32 and all(token not in " ".join(s.argv) for s in specs)
    for spec in specs:  # each child reads it back from its environment
        monkeypatch.setenv("PAGEDSERVE_INTERNAL_TOKEN", spec.env["PAGEDSERVE_INTERNAL_TOKEN"])
        assert child_config(spec)[1].internal_token == token
    monkeypatch.delenv("PAGEDSERVE_INTERNAL_TOKEN")
    again = service_specs(build_parser().parse_args(argv))[0].env["PAGEDSERVE_INTERNAL_TOKEN"]
    assert again != token  # a fresh one per launch
    given = service_specs(build_parser().parse_args(["serve", "--internal-token", "x" * 20]))
    assert {s.env["PAGEDSERVE_INTERNAL_TOKEN"] for s in given} == {"x" * 20}
    open_ = service_specs(build_parser().parse_args(["serve", "--insecure-internal"]))
    assert not any("PAGEDSERVE_INTERNAL_TOKEN" in s.env for s in open_)
    assert "--insecure-internal" in open_[0].argv and "--insecure-internal" in open_[1].argv


def test_serve_with_replicas_and_gateways_starts_each_pair_then_every_gateway_on_all_of_them():
    args = build_parser().parse_args(["serve", "--replicas", "2", "--gateways", "2", "--port", "7000",
                                      "--routing", "round-robin", "--session-lease", "3",
                                      "--metrics-port", "9000"])
    specs = service_specs(args)
    assert [s.name for s in specs] == ["memsvc", "executor", "memsvc-1", "executor-1", "gateway", "gateway-1"]
    assert specs[0].restart_with == ["executor"] and specs[2].restart_with == ["executor-1"]
    pairs = [f"{specs[i].address},{specs[i + 1].address}" for i in (0, 2)]
    for i, spec in enumerate(specs[4:]):
        gateway = child_config(spec)[1]
        assert spec.address == f"127.0.0.1:{7000 + i}"
        assert gateway.replica == pairs and gateway.routing == "round-robin"
        assert gateway.http_port == (8000 if i == 0 else 0)
        assert gateway.metrics_port == (9000 if i == 0 else 0)
    assert child_config(specs[2])[1].memory.session_lease == 3
    # every memsvc and executor gets a metrics port that the first gateway's /metrics scrapes
    ports = [child_config(s)[1].metrics_port for s in specs[:4]]
    assert all(ports) and child_config(specs[4])[1].metrics_upstream == [
        f"{name}=http://127.0.0.1:{port}/metrics"
        for name, port in zip(["memsvc", "executor", "memsvc-1", "executor-1"], ports)]
    assert child_config(specs[5])[1].metrics_upstream == []


def test_bad_settings_exit_2_before_anything_starts(capsys):
    args = build_parser().parse_args(["serve", "--replicas", "0"])
    assert args.run(args) == 2
    assert "--replicas" in capsys.readouterr().err


def test_serve_help_groups_flags_by_service(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    out = capsys.readouterr().out
    headings = [line.rstrip(":") for line in out.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert {"memsvc", "executor", "gateway"} <= set(headings)
    for flag in ("--preemption-mode", "--swap-space", "--policy", "--device", "--tls-cert",
                 "--trace-file", "--otlp-endpoint", "--max-num-seqs", "--api-key", "--internal-token",
                 "--insecure-internal"):
        assert flag in out, flag



def test_drain_timeout_is_one_flag_that_the_gateways_drain_by_and_serve_waits_for(capsys):
    specs = service_specs(build_parser().parse_args(["serve", "--replicas", "2", "--gateways", "2",
                                                     "--drain-timeout", "45"]))
    waves = {s.name: s.stop_wave for s in specs}
    assert waves == {"gateway": 0, "gateway-1": 0, "executor": 1, "executor-1": 1, "memsvc": 2, "memsvc-1": 2}
    for spec in specs:
        config = child_config(spec)[1]
        if spec.name.startswith("gateway"):
            assert config.drain_timeout == 45 and spec.stop_grace == 45 + STOP_AFTER_DRAIN_S
        elif spec.name.startswith("executor"):
            assert config.drain_timeout == 0
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    described = [line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("--drain-timeout")]
    assert len(described) == 1
