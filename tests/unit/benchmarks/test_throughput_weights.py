"""bench throughput's model size: the parameters (the ceiling's FLOPs per token) do not depend
on the linear backend, and the bytes a one-token step reads follow the form each layer holds."""
import pytest
import torch

from pagedserve.benchmarks.throughput import model_weights
from pagedserve.executor import linear_backend
from pagedserve.executor.model_loader import load_model
from tests.support.tiny_models import make_tiny_model

ONEDNN = linear_backend.onednn_unavailable(torch.device("cpu"), torch.float32) is None


@pytest.mark.parametrize("tie", [True, False])
def test_parameters_whatever_the_backend(tmp_path, tie):
    make_tiny_model(tmp_path, "qwen2", tie=tie)
    model, config = load_model(str(tmp_path))
    everything = sum(p.numel() for p in model.parameters())
    params, read = model_weights(model)
    embed = model.embed.numel() * 4
    assert params == everything and read == everything * 4 - (0 if tie else embed)
    if ONEDNN:
        linear_backend.configure(model, "onednn")
        assert model_weights(model) == (params, read)  # packed float32: the same bytes
    model, _ = load_model(str(tmp_path))  # oneDNN dropped the dense weights: a fresh one
    linear_backend.configure(model, "dot")  # the dense weights read in place: the same bytes
    assert model_weights(model) == (params, read)
