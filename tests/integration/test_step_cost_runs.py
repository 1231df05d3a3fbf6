"""`bench step-cost`: the step path in one process over the wire's round trips (the default
model's tokenizer); every token comes out, memsvc holds nothing after, and each part is counted."""
import json

import pytest

from pagedserve.benchmarks import step_cost


@pytest.fixture(autouse=True)
def no_freeze(monkeypatch):  # the services freeze their heap once started; a test process must not
    import pagedserve.rpc.heap

    monkeypatch.setattr(pagedserve.rpc.heap, "freeze_heap", lambda: 0)


def test_every_part_is_counted_and_nothing_is_left(tmp_path, capsys):
    r = step_cost.measure(batch=4, input_len=8, output_len=6)  # raises on a lost token or a leak
    assert r["steps"] >= 6
    assert {"plan", "on_reserved", "on_sampled", "deltas", "memsvc reserve", "executor expand",
            "step encode"} <= set(r["parts_ms"])
    assert all(ms >= 0 for ms in r["parts_ms"].values())


def test_json_out(tmp_path, capsys):
    class Args:
        batch_sizes, input_len, output_len, json, out = "2", 4, 3, True, str(tmp_path / "r.json")

    assert step_cost.run(Args()) == 0
    printed = json.loads(capsys.readouterr().out)
    saved = json.loads((tmp_path / "r.json").read_text())
    assert set(printed) == {"2"} and saved["results"]["2"]["steps"] == printed["2"]["steps"]
    assert "model_name" in saved["cpu"]
