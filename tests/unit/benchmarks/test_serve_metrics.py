from pagedserve.benchmarks.serve_metrics import RequestTiming, summarize
from pagedserve.benchmarks.workloads import load_trace, poisson_arrivals, sample_lengths


def test_summary_of_hand_made_timings():
    a = RequestTiming(0.0, [0.5, 0.6, 0.7], 0.7, 3)
    b = RequestTiming(1.0, [1.2, 1.6], 1.6, 2)
    c = RequestTiming(1.0, [], 1.1, 0, status="RESOURCE_EXHAUSTED")
    r = summarize([a, b, c], 2.0, slo_ttft=0.3)
    assert r["completed"] == 2 and r["errors"] == {"RESOURCE_EXHAUSTED": 1}
    assert abs(r["ttft_s"]["mean"] - 0.35) < 1e-9
    assert abs(r["tpot_s"]["mean"] - (0.1 + 0.4) / 2) < 1e-9
    assert abs(r["normalized_latency_s_per_token"] - (0.7 / 3 + 0.6 / 2) / 2) < 1e-9
    assert r["goodput_requests_per_s"] == 0.5  # only b meets TTFT <= 0.3
    assert r["output_token_throughput"] == 2.5


def test_workloads_are_deterministic_and_shaped():
    a = sample_lengths("sharegpt", 2000, seed=3)
    assert a == sample_lengths("sharegpt", 2000, seed=3)
    mean_in = sum(r.prompt_len for r in a) / len(a)
    mean_out = sum(r.output_len for r in a) / len(a)
    assert 130 < mean_in < 180 and 280 < mean_out < 360
    assert max(r.prompt_len + r.output_len for r in a) <= 2048
    alp = sample_lengths("alpaca", 2000, seed=3)
    assert 15 < sum(r.prompt_len for r in alp) / 2000 < 23
    poisson_arrivals(a, 10.0, seed=1)
    gaps = [y.arrival - x.arrival for x, y in zip(a, a[1:])]
    assert 0.08 < sum(gaps) / len(gaps) < 0.12


def test_trace_format(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text('{"arrival": 0.5, "prompt_len": 10, "output_len": 4}\n'
                 '{"arrival": 1, "prompt": "hello", "output_len": 2}\n')
    t = load_trace(str(p))
    assert [(r.arrival, r.prompt_len, r.output_len, r.prompt) for r in t] == [
        (0.5, 10, 4, None), (1.0, 0, 2, "hello")]
    p.write_text('{"arrival": 0}\n')
    import pytest

    with pytest.raises(ValueError, match="t.jsonl:1"):
        load_trace(str(p))
