"""Linear layers routed while the model loads (pagedserve.executor.linear_backend.Planner through
load_model's on_built): a layer on oneDNN at every M holds no dense weight from the moment
the next layer is read, a shared weight (a tied embedding) is kept, outputs still match
transformers; the checkpoint's file is not kept mapped."""
import pytest
import torch

from pagedserve.executor import linear_backend
from pagedserve.executor.linear import Linear
from pagedserve.executor.model_loader import load_model
from pagedserve.executor.models.llama import DecoderLayer
from tests.support.tiny_models import make_tiny_model
from tests.unit.executor.test_linear_backend import TOL, needs_onednn, worst_logit_difference


def linears(module):
    return [m for m in module.modules() if isinstance(m, Linear)]


@needs_onednn
@pytest.mark.parametrize("arch,tie", [("qwen3", True), ("llama_bias", False), ("phi3", False)])
def test_dense_weights_dropped_layer_by_layer(tmp_path, arch, tie):
    hf = make_tiny_model(tmp_path, arch, tie=tie, num_hidden_layers=3)
    planner = linear_backend.Planner("onednn")
    built: list[DecoderLayer] = []
    still_dense: list[int] = []  # at each layer built: how many earlier layers hold a dense weight

    def on_built(module):
        if isinstance(module, DecoderLayer):
            still_dense.append(sum(m.weight is not None for layer in built for m in linears(layer)))
            built.append(module)
        planner.place(module)

    model, config = load_model(str(tmp_path), on_built=on_built)
    plan = planner.finish()

    assert still_dense == [0] * config.num_layers
    for m in linears(model):
        assert m.packed is not None
        if m is model.lm_head and tie:
            assert m.weight is model.embed  # shared with the embedding: kept
        else:
            assert m.weight is None
    assert all(c.routes == [(None, "onednn")] for c in plan)
    assert sum(c.layers for c in plan) == len(linears(model))
    assert worst_logit_difference(hf, model, config) <= TOL


@needs_onednn
def test_a_later_failed_prepack_puts_the_rest_of_its_shape_on_f_linear(tmp_path, monkeypatch):
    make_tiny_model(tmp_path, "llama3", num_hidden_layers=3)
    planner = linear_backend.Planner("onednn")

    def broken(weight):
        raise RuntimeError("no oneDNN here")

    def on_built(module):
        planner.place(module)
        if isinstance(module, DecoderLayer):  # after the first layer,
            monkeypatch.setattr("pagedserve.executor.linear.onednn_pack", broken)  # every prepack fails

    model, _ = load_model(str(tmp_path), on_built=on_built)
    plan = planner.finish()
    first = model.layers[0]
    assert all(m.routes == [(None, "onednn")] and m.weight is None for m in linears(first))
    for layer in model.layers[1:]:
        assert all(m.routes == [(None, "mkl")] and m.weight is not None for m in linears(layer))
    by_shape: dict = {}
    for c in plan:
        by_shape.setdefault((c.out_features, c.in_features), []).append((c.routes, c.layers))
    for shape, entries in by_shape.items():
        if shape == tuple(model.lm_head.shape) and len(entries) == 1:
            assert entries == [([(None, "mkl")], 1)]  # placed after the failure began
            continue
        assert entries == [([(None, "onednn")], 1), ([(None, "mkl")], 2)]


def test_mixed_routes_within_the_margin_go_all_onednn():
    close = {1: {"mkl": 1.0, "onednn": 1.2}, 64: {"mkl": 2.0, "onednn": 1.0}}
    assert linear_backend.routes_from(close) == [(None, "onednn")]
    far = {1: {"mkl": 1.0, "onednn": 1.5}, 64: {"mkl": 2.0, "onednn": 1.0}}
    assert linear_backend.routes_from(far) == [(8, "mkl"), (None, "onednn")]
    mkl_everywhere = {1: {"mkl": 1.0, "onednn": 1.2}, 64: {"mkl": 1.0, "onednn": 1.2}}
    assert linear_backend.routes_from(mkl_everywhere) == [(None, "mkl")]
    within_noise = {1: {"mkl": 1.0, "onednn": 1.05}, 64: {"mkl": 1.0, "onednn": 1.05}}
    assert linear_backend.routes_from(within_noise) == [(None, "onednn")]


def test_checkpoint_file_not_kept_mapped(tmp_path):
    maps = "/proc/self/maps"
    try:
        open(maps).close()
    except OSError:
        pytest.skip("no /proc/self/maps here")
    make_tiny_model(tmp_path, "qwen2")
    model, _ = load_model(str(tmp_path))
    with open(maps) as f:
        assert str(tmp_path / "model.safetensors") not in f.read()
    assert model.embed.untyped_storage().nbytes() == model.embed.numel() * model.embed.element_size()
