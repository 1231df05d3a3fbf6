"""pagedserve.serve_cmd: the services `serve` starts, with replicas and several gateways."""
import argparse

from pagedserve.serve_cmd import add_parsers, service_specs, with_reliability


def test_serve_with_replicas_and_gateways_starts_each_pair_then_every_gateway_on_all_of_them():
    parser = argparse.ArgumentParser()
    add_parsers(parser.add_subparsers())
    args = parser.parse_args(["serve", "--replicas", "2", "--gateways", "2", "--port", "7000",
                              "--routing", "round-robin", "--session-lease", "3", "--metrics-port", "9000"])
    specs = with_reliability(service_specs(args), args)
    assert [s.name for s in specs] == ["memsvc", "executor", "memsvc-1", "executor-1", "gateway", "gateway-1"]
    assert specs[0].restart_with == ["executor"] and specs[2].restart_with == ["executor-1"]
    pairs = [f"{specs[i].address},{specs[i + 1].address}" for i in (0, 2)]
    for i, gateway in enumerate(specs[4:]):
        argv = gateway.argv
        assert gateway.address == f"127.0.0.1:{7000 + i}"
        assert [argv[j + 1] for j, a in enumerate(argv) if a == "--replica"] == pairs
        assert argv[argv.index("--routing") + 1] == "round-robin"
        assert argv[argv.index("--http-port") + 1] == ("8000" if i == 0 else "0")
        assert argv[argv.index("--metrics-port") + 1] == ("9000" if i == 0 else "0")
    assert float(specs[2].argv[specs[2].argv.index("--session-lease") + 1]) == 3
    single = service_specs(parser.parse_args(["serve"]))
    assert [s.name for s in single] == ["memsvc", "executor", "gateway"]
