"""The opt-in int4 weights (pagedserve/executor/linear_int4.py, --linear-backend int4): Q4_1 read back
exactly from its float32 image, the matmul against the dequantized float reference, the
refusals (not Q4_1, no kernel, not float32), a tiny Q4_1 model (the default model on it:
tests/integration/test_linear_default_model.py)."""
import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedserve.benchmarks.int8_accuracy import prefill_logits
from pagedserve.executor import linear_backend, linear_int4
from pagedserve.executor.linear import Linear
from pagedserve.executor.model_loader import load_model
from tests.support.tiny_models import make_tiny_model
from tests.unit.executor.test_linear_backend import log_records  # noqa: F401 (fixture)

INT4 = linear_int4.unavailable(torch.device("cpu"), torch.float32) is None
pytestmark = pytest.mark.skipif(not INT4, reason="no int4 CPU kernel in this torch build")
G = linear_int4.GROUP


def q4_1(n: int, k: int, seed: int = 0):
    """Random Q4_1 weights: (their float32 image [n, k], q, d, m), every group using q = 0 and
    15, as llama.cpp's quantizer leaves them, one group constant."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k // G, G), generator=g)
    q[..., 0], q[..., 1] = 0, 15
    d = (torch.rand(n, k // G, generator=g) * 0.02 + 1e-3).half().float()
    m = (-7.5 * d + 0.01 * torch.randn(n, k // G, generator=g)).half().float()
    q[0, 0], d[0, 0] = 0, 0.0
    w = q * d[..., None] + m[..., None]
    return w.view(n, k), q.view(n, k), d, m


def test_q4_1_is_read_back_exactly():
    w, q, d, m = q4_1(48, 96)
    got_q, got_d, got_m = linear_int4.q4_1_parts(w)
    assert torch.equal(got_q.long(), q) and torch.equal(got_d, d) and torch.equal(got_m, m)


def test_not_q4_1_is_refused_naming_the_layer_and_the_fix():
    w = q4_1(32, 64)[0]
    w[3, 40] += 1e-4
    with pytest.raises(linear_int4.NotQ4_1, match=r"linear 32x64: not Q4_1 weights: 1 of 64 groups .*row 3, columns 32-63"):
        linear_int4.pack(w)
    with pytest.raises(linear_int4.NotQ4_1, match="--dtype float32"):
        linear_int4.pack(q4_1(32, 64)[0].bfloat16())
    with pytest.raises(linear_int4.NotQ4_1, match="multiple of 32"):
        linear_int4.pack(torch.zeros(32, 48))


@pytest.mark.parametrize("m", [1, 5, 64])
def test_matmul_equals_the_dequantized_float_reference(m):
    """Against the kernel's own weights ((q - 8) * scale + zero, bfloat16 scale and zero) on
    bfloat16-rounded x: within the output's bfloat16 rounding (2^-8 of sum |x w|). Against the
    float32 Q4_1 weights on float32 x: within 2^-8 of sum |x| (|w| + 16 |d| + |m|), the bound
    of the rounding of x, of d and of m + 8 d to bfloat16, and of the output."""
    w, q, d, mins = q4_1(64, 128, seed=m)
    g = torch.Generator().manual_seed(7)
    x, bias = torch.randn(m, 128, generator=g), torch.randn(64, generator=g)
    packed = linear_int4.pack(w)
    got = linear_int4.matmul(x, packed, bias)
    assert got.dtype == torch.float32 and got.shape == (m, 64)
    product = got.double() - bias.double()
    kernel_w = linear_int4.dequantize(q, packed)
    exact = x.bfloat16().double() @ kernel_w.T
    assert ((product - exact).abs() <= (x.bfloat16().double().abs() @ kernel_w.abs().T) * 2 ** -8).all()
    expand = lambda t: t.double().repeat_interleave(G, 1)  # noqa: E731
    bound = x.double().abs() @ (w.double().abs() + 16 * expand(d) + expand(mins).abs()).T * 2 ** -8
    assert ((product - x.double() @ w.double().T).abs() <= bound).all()


def test_a_view_at_an_offset_is_realigned():
    packed = linear_int4.pack(q4_1(32, 64)[0])
    x = torch.randn(5, 64).bfloat16()
    torch.testing.assert_close(linear_int4.matmul(x[1:], packed, None), linear_int4.matmul(x[1:].clone(), packed, None))


def test_refused_where_the_kernel_is_missing_or_not_float32(monkeypatch):
    assert "int4" in linear_backend.CHOICES and "int4" not in linear_backend.TIMED
    with pytest.raises(ValueError, match="--linear-backend int4: .*--dtype float32"):
        linear_backend.Planner("int4", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="CPU only"):
        linear_backend.Planner("int4", device="meta")
    monkeypatch.setattr(linear_int4, "OPS", ("_no_such_int4_op",))
    with pytest.raises(ValueError, match="lacks torch.ops.aten._no_such_int4_op: use --linear-backend auto"):
        linear_backend.Planner("int4")


def make_q4_1_model(path, tie: bool = False):
    """A tiny qwen2 whose decoder weights are Q4_1 images (the embedding and an untied LM
    head stay as they are: float32, like the default model's Q8_0 embedding)."""
    make_tiny_model(path, "qwen2", tie=tie)
    tensors = load_file(str(path / "model.safetensors"))
    for i, (name, t) in enumerate(sorted(tensors.items())):
        if name.startswith("model.layers.") and t.dim() == 2:
            tensors[name] = q4_1(*t.shape, seed=i)[0]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("tie", [True, False])
def test_tiny_q4_1_model_on_int4(tmp_path, tie, log_records):  # noqa: F811
    make_q4_1_model(tmp_path, tie)
    ref, config = load_model(str(tmp_path))
    planner = linear_backend.Planner("int4")
    model, _ = load_model(str(tmp_path), on_built=planner.place)
    plan = {(c.out_features, c.in_features): c.routes for c in planner.finish()}
    assert plan.pop((config.vocab_size, config.hidden_size)) != [(None, "int4")]  # 300 rows: not Q4_1
    assert plan and all(r == [(None, "int4")] for r in plan.values())
    assert any(r.getMessage().startswith(f"linear {config.vocab_size}x") and "timed as for auto" in r.getMessage()
               for r in log_records)
    for layer in model.layers.modules():
        if isinstance(layer, Linear):
            assert layer.weight is None and isinstance(layer.prepared["int4"], linear_int4.Int4Weight)
    g = torch.Generator().manual_seed(3)
    for n in (21, 9):
        ids = torch.randint(0, config.vocab_size, (n,), generator=g).tolist()
        a, b = prefill_logits(ref, config, ids), prefill_logits(model, config, ids)
        spread = (a.amax(-1) - a.amin(-1)).min().item()
        assert (a - b).abs().max().item() <= 0.05 * spread


def test_a_model_without_q4_1_weights_is_refused(tmp_path):
    make_tiny_model(tmp_path, "qwen2")
    with pytest.raises(ValueError, match="first decoder layer holds no Q4_1 weights .*--linear-backend auto"):
        load_model(str(tmp_path), on_built=linear_backend.Planner("int4").place)
