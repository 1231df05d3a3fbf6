"""`bench control-plane`'s simulation flags and busy/idle/CPU arithmetic, without processes."""
import argparse

import pytest

from pagedserve.benchmarks import control_plane


def parse(*argv):
    parser = argparse.ArgumentParser()
    control_plane.add_parser(parser.add_subparsers())
    return parser.parse_args(["control-plane", *argv])


@pytest.mark.parametrize("argv, message", [
    (["--simulate", "llama-9b@h200"], "llama-8b"),
    (["--simulate-step-ms", "-1"], "--simulate-step-ms must be positive"),
])
def test_bad_simulation_flags_stop_before_any_process(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(control_plane, "start_services", lambda *a: pytest.fail("started services"))
    assert control_plane.run(parse(*argv, "--out", "")) == 2
    assert message in capsys.readouterr().err


def test_measure_busy_adds_busy_idle_and_cpu(monkeypatch):
    monkeypatch.setattr(control_plane, "measure", lambda *a: {"ms_per_step": 10.0, "steps": 4})
    simulated = iter([1.0, 1.03])  # 30 ms slept over a 40 ms run
    r = control_plane.measure_busy(None, 4, 8, 4, "t", {"gateway": None}, lambda: next(simulated))
    assert r["busy"] == pytest.approx(0.75) and r["idle_ms"] == pytest.approx(2.5)
    assert set(r["cpu_ms"]) == {"gateway"} and r["cpu_ms"]["gateway"] >= 0
