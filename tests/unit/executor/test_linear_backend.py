"""The linear layers' backend (pagedserve.executor.linear, pagedserve.executor.linear_backend): each forced backend
and "auto" give transformers' logits and greedy tokens on tiny models; a failing oneDNN falls
back to F.linear with a log line; auto's timings are kept per machine and reused. Timings on
this shared machine count as idle here (the rules for busy ones: test_linear_plan.py)."""
import logging

import pytest
import torch

from pagedserve.executor import linear_auto, linear_backend, linear_plan_cache, linear_timing
from pagedserve.executor.config import LINEAR_BACKENDS
from pagedserve.executor.linear import Linear
from pagedserve.executor.model_loader import load_model
from pagedserve.executor.model_runner import ModelRunner
from pagedserve.engine import LLMEngine
from tests.support.tiny_models import make_tiny_model, paged_batches, save_tiny_tokenizer
from pagedserve.wire.protocol import SamplingParams

TOL = 1e-3  # test_model_logits' tolerance
ONEDNN = linear_backend.onednn_unavailable(torch.device("cpu"), torch.float32) is None
needs_onednn = pytest.mark.skipif(not ONEDNN, reason="no oneDNN in this torch build")


@pytest.fixture(autouse=True)
def own_plan_cache(tmp_path_factory, monkeypatch):
    """Timings kept in a folder of this test's own (pagedserve.executor.linear_plan_cache)."""
    folder = tmp_path_factory.mktemp("plan-cache")
    monkeypatch.setattr(linear_plan_cache, "path", lambda: str(folder / linear_plan_cache.FILE_NAME))


@pytest.fixture(autouse=True)
def idle_machine(monkeypatch):
    monkeypatch.setattr(linear_timing, "why_busy", lambda others, spread: None)


@pytest.fixture
def log_records():
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("pagedserve.executor")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    yield records
    logger.removeHandler(handler)
    logger.setLevel(level)


def routes_by_shape(model):
    return {m.shape: m.routes for m in model.modules() if isinstance(m, Linear)}


def worst_logit_difference(hf, model, config) -> float:
    """Teacher-forced logits over two sequences in chunked, paged steps vs transformers."""
    pool = torch.zeros(32, config.num_layers, 2, 4, config.num_kv_heads, config.head_dim)
    runner = ModelRunner(model, config, pool)
    g = torch.Generator().manual_seed(3)
    a, b = (torch.randint(0, config.vocab_size, (n,), generator=g).tolist() for n in (21, 9))
    steps = [[("a", a[:12]), ("b", b[:-1])], [("a", a[12:20]), ("b", b[-1:])], [("a", a[20:])]]
    got: dict[str, list[torch.Tensor]] = {}
    for batch in paged_batches(steps, 4, 32, seed=1):
        logits, starts = runner.logits(batch), batch.starts
        for i, seq_id in enumerate(batch.seq_ids):
            got.setdefault(seq_id, []).append(logits[starts[i]:starts[i + 1]])
    worst = 0.0
    for seq_id, ids in (("a", a), ("b", b)):
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].float()
        worst = max(worst, (torch.cat(got[seq_id]) - ref).abs().max().item())
    return worst


def test_config_choices_are_the_backends():
    assert LINEAR_BACKENDS == linear_backend.CHOICES


@pytest.mark.parametrize("backend", ["mkl", pytest.param("onednn", marks=needs_onednn)])
@pytest.mark.parametrize("arch,tie", [("llama_bias", False), ("qwen3", True), ("gemma2", True),
                                      ("phi3", False), ("mixtral", False)])
def test_forced_backend_matches_transformers(tmp_path, arch, tie, backend):
    hf = make_tiny_model(tmp_path, arch, tie=tie)
    model, config = load_model(str(tmp_path))
    plan = linear_backend.configure(model, backend)
    assert plan and all(c.routes == [(None, backend)] for c in plan)
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    assert all(m.routes == [(None, backend)] for m in layers)
    assert all((m.packed is not None) == (backend == "onednn") for m in layers)
    assert worst_logit_difference(hf, model, config) <= TOL


def test_auto_picks_a_backend_per_shape_and_records_it(tmp_path, log_records):
    hf = make_tiny_model(tmp_path, "qwen2")
    model, config = load_model(str(tmp_path))
    plan = linear_backend.configure(model, "auto")
    shapes = routes_by_shape(model)
    assert sorted((c.out_features, c.in_features) for c in plan) == sorted(shapes)
    for c in plan:
        assert c.routes == shapes[(c.out_features, c.in_features)]
        assert c.routes[-1][0] is None and {b for _, b in c.routes} <= set(linear_backend.BACKENDS)
        if ONEDNN:
            assert set(c.seconds) == set(linear_backend.STEP_ROWS)
            assert all(set(t) == set(linear_backend.TIMED) for t in c.seconds.values())
        assert c.as_dict()["shape"] == [c.out_features, c.in_features]
    logged = [r.getMessage() for r in log_records]
    assert len([m for m in logged if m.startswith("linear ")]) == len(plan)
    assert worst_logit_difference(hf, model, config) <= TOL


def test_routes_split_at_the_geometric_midpoints():
    s = {1: {"mkl": 1.0, "onednn": 2.0}, 64: {"mkl": 2.0, "onednn": 1.0},
         512: {"mkl": 2.0, "onednn": 1.0}}
    assert linear_backend.routes_from(s) == [(8, "mkl"), (None, "onednn")]
    layer = Linear(torch.randn(6, 4))
    layer.route([(8, "mkl"), (None, "mkl")])
    assert [layer.backend_for(m) for m in (1, 7, 8, 500)] == ["mkl"] * 4


@needs_onednn
def test_failing_onednn_call_falls_back_to_f_linear(monkeypatch, log_records):
    layer = Linear(torch.randn(12, 8), torch.randn(12))
    layer.route([(4, "mkl"), (None, "onednn")])
    assert layer.packed is not None
    x = torch.randn(6, 8)
    expected = torch.nn.functional.linear(x, layer.weight, layer.bias)

    def broken(*args):
        raise RuntimeError("oneDNN broke")
    monkeypatch.setattr("pagedserve.executor.linear.onednn_linear", broken)
    assert torch.allclose(layer(x), expected)
    assert layer.routes == [(None, "mkl")] and layer.packed is None
    assert any("oneDNN call on (6, 8) failed" in r.getMessage() and "F.linear" in r.getMessage()
               for r in log_records)
    assert torch.allclose(layer(x), expected)


def test_failing_onednn_prepack_leaves_every_layer_on_f_linear(tmp_path, monkeypatch, log_records):
    make_tiny_model(tmp_path, "llama3")
    model, _ = load_model(str(tmp_path))

    def broken(weight):
        raise RuntimeError("no oneDNN here")
    monkeypatch.setattr("pagedserve.executor.linear.onednn_pack", broken)
    for backend in ("onednn", "auto"):
        log_records.clear()
        plan = linear_backend.configure(model, backend)
        assert all(c.routes == [(None, "mkl")] and c.source == "untimed" for c in plan)
        assert all(r == [(None, "mkl")] for r in routes_by_shape(model).values())
        failed = [r.getMessage() for r in log_records if "preparing for oneDNN failed" in r.getMessage()]
        assert len(failed) == len(plan) and all("F.linear" in m for m in failed)  # one line a shape


@pytest.mark.parametrize("backend", ["mkl", pytest.param("onednn", marks=needs_onednn), "dot", "auto"])
def test_engine_greedy_matches_transformers_per_backend(tmp_path, backend):
    hf = make_tiny_model(tmp_path, "mistral_swa")
    save_tiny_tokenizer(tmp_path)
    prompts = [[5, 17, 42, 8, 99, 23], [7, 3, 250, 11]]
    hf.generation_config.eos_token_id = None
    expected = []
    for p in prompts:
        with torch.inference_mode():
            y = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, pad_token_id=0)
        expected.append(y[0, len(p):].tolist())
    engine = LLMEngine(model=str(tmp_path), block_size=4, kv_tokens=256, linear_backend=backend,
                       device="cpu")
    plan = engine.executor.linear_plan
    assert plan and all({b for _, b in c.routes} <= set(linear_backend.BACKENDS) for c in plan)
    if backend != "auto":
        assert all(c.routes == [(None, backend)] for c in plan)
    sampling = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    assert [o.completions[0].token_ids for o in engine.generate(prompts, sampling)] == expected


def test_mkl_must_win_by_the_margin_to_serve_an_m():
    close = {1: {"mkl": 1.0, "onednn": 1.05}, 64: {"mkl": 1.0, "onednn": 1.5}, 512: {"mkl": 1.0, "onednn": 0.9}}
    assert linear_backend.routes_from(close) == [(8, "onednn"), (182, "mkl"), (None, "onednn")]


def test_ahead_somewhere_level_elsewhere_the_dense_weight_serves_all():
    """Clearly ahead at one M, nowhere behind beyond the noise: one copy, the dense weight
    (not oneDNN where the lead is under PREFER_MARGIN, which would keep both copies)."""
    ahead = {1: {"mkl": 1.0, "onednn": 1.05}, 64: {"mkl": 1.0, "onednn": 1.5}}
    assert linear_backend.routes_from(ahead) == [(None, "mkl")]
    with_dot = {1: {"mkl": 2.0, "onednn": 1.5, "dot": 1.0}, 64: {"mkl": 1.0, "onednn": 1.1, "dot": 1.02},
                512: {"mkl": 1.0, "onednn": 0.98, "dot": 1.01}}  # oneDNN 2% ahead at 512: noise
    assert linear_backend.routes_from(with_dot) == [(8, "dot"), (None, "mkl")]
    behind = {1: {"mkl": 1.0, "onednn": 1.5, "dot": 2.0}, 64: {"mkl": 1.0, "onednn": 0.95, "dot": 1.1}}
    assert linear_backend.routes_from(behind) == [(8, "mkl"), (None, "onednn")]  # 1.5x at one row: both copies


def test_a_shared_dense_weight_gets_a_onednn_copy_only_for_a_clear_win():
    """A tied LM head holds the embedding's weight anyway: oneDNN's copy would be a second."""
    level = {1: {"mkl": 2.0, "onednn": 1.0, "dot": 1.01}, 64: {"mkl": 2.0, "onednn": 1.0, "dot": 1.06}}
    assert linear_backend.routes_from(level) == [(None, "onednn")]
    assert linear_backend.routes_from(level, shared=True) == [(None, "dot")]
    slight = {1: {"mkl": 1.0, "onednn": 1.0, "dot": 1.2}, 64: {"mkl": 1.2, "onednn": 1.0, "dot": 1.15}}
    assert linear_backend.routes_from(slight, shared=True) == [(8, "mkl"), (None, "dot")]  # 1.15x < MIXED_MARGIN
    clear = {1: {"mkl": 1.0, "onednn": 1.0, "dot": 1.2}, 64: {"mkl": 2.0, "onednn": 1.0, "dot": 1.5}}
    assert linear_backend.routes_from(clear, shared=True) == [(8, "mkl"), (None, "onednn")]


@needs_onednn
def test_timings_are_kept_per_machine_and_reused(tmp_path, monkeypatch, log_records):
    """Reused after one check: the largest shape timed again at every M, each other shape of
    the first layer at M=64 only (alike here), once."""
    make_tiny_model(tmp_path, "qwen2")
    timed = []

    def fake(layer, rows):  # MKL ahead at one row on the square shapes, behind above: a mixed plan
        timed.append((layer.shape, rows))
        square = layer.shape[0] == layer.shape[1]
        return linear_timing.Timing({m: {"mkl": m * (0.5 if square and m == 1 else 1.2), "onednn": 1.0 * m}
                                     for m in rows})
    monkeypatch.setattr(linear_auto, "time_shape", fake)
    model, _ = load_model(str(tmp_path))
    plan = linear_backend.configure(model)
    first = {(c.out_features, c.in_features): (c.routes, c.seconds) for c in plan}
    assert sorted(s for s, _ in timed) == sorted(first) and {c.source for c in plan} == {"timed"}
    assert any(r == [(8, "mkl"), (None, "onednn")] for r, _ in first.values())
    timed.clear()
    model, _ = load_model(str(tmp_path))
    plan = linear_backend.configure(model)
    again = {(c.out_features, c.in_features): (c.routes, c.seconds) for c in plan}
    assert again == first
    shapes = [s for s, _ in timed]
    assert len(shapes) == len(set(shapes)) > 1 and set(shapes) <= set(first)
    assert timed[0] == (max(first, key=lambda s: s[0] * s[1]), linear_backend.STEP_ROWS)
    assert all(rows == (64,) for _, rows in timed[1:])
    assert {c.source for c in plan} == {"cache"} and all(c.note.startswith("checked idle") for c in plan)
    assert any("timings kept from an earlier load" in r.getMessage() for r in log_records)


@needs_onednn
def test_an_unreadable_plan_file_is_timed_again_and_rewritten(tmp_path, monkeypatch, log_records):
    with open(linear_plan_cache.path(), "w") as f:
        f.write("{not json")
    layer = Linear(torch.randn(24, 16))
    plan = linear_backend.configure(layer, "auto", rows=(1, 4))
    assert set(plan[0].seconds) == {1, 4}
    assert any("unreadable" in r.getMessage() for r in log_records)
    k = linear_plan_cache.key((24, 16), torch.float32, (1, 4))
    assert linear_plan_cache.load(k) == plan[0].seconds
