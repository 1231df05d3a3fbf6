"""--kv-cache-dtype (pagedserve.executor.executor.kv_cache_dtype_of): a bfloat16 KV cache under
float32 weights on the CPU holds the pool in bfloat16 (half the bytes per token), keeps the
logits close to a float32 cache's and the greedy tokens equal on tiny models; a pool of another
dtype, or another KV dtype than the model's on a GPU, is refused naming the flag."""
import pytest
import torch

from pagedserve.engine import LLMEngine
from pagedserve.executor.executor import kv_cache_dtype_of
from pagedserve.executor.model_loader import load_model
from pagedserve.executor.model_runner import ModelRunner
from pagedserve.wire.protocol import SamplingParams
from tests.support.tiny_models import make_tiny_model, paged_batches, save_tiny_tokenizer

# bfloat16 keeps 8 mantissa bits: K/V relative error <= 2^-9; on these tiny random models'
# logits (magnitude ~1) the difference stays well under this
LOGIT_TOL = 0.05
STEPS = [[("a", list(range(5, 25))), ("b", [7, 3, 250, 11, 42])],
         [("a", [31]), ("b", [8, 99, 23, 17])],
         [("a", [64]), ("b", [2])]]


def run_logits(model, config, dtype):
    pool = torch.zeros(32, config.num_layers, 2, 4, config.num_kv_heads, config.head_dim, dtype=dtype)
    runner = ModelRunner(model, config, pool, kv_dtype=dtype)
    return torch.cat([runner.logits(b) for b in paged_batches(STEPS, 4, 32, seed=1)])


@pytest.mark.parametrize("arch,dtype", [("llama3", torch.bfloat16), ("qwen3", torch.bfloat16),
                                        ("gemma2", torch.bfloat16), ("llama3", torch.float16)])
def test_16_bit_cache_logits_close_to_float32(tmp_path, arch, dtype):
    make_tiny_model(tmp_path, arch)
    model, config = load_model(str(tmp_path))
    exact = run_logits(model, config, torch.float32)
    half = run_logits(model, config, dtype)
    assert half.dtype == torch.float32 and half.shape == exact.shape
    assert 0 < (half - exact).abs().max().item() <= LOGIT_TOL


@pytest.fixture
def tiny(tmp_path):
    hf = make_tiny_model(tmp_path, "llama3")
    save_tiny_tokenizer(tmp_path)
    hf.generation_config.eos_token_id = None
    return str(tmp_path)


def greedy(engine):
    prompts = [[5, 17, 42, 8, 99, 23], [7, 3, 250, 11], list(range(40, 58))]
    sampling = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    return [o.completions[0].token_ids for o in engine.generate(prompts, sampling)]


@pytest.mark.parametrize("impl", ["native", "transformers"])
def test_engine_bfloat16_cache_half_the_bytes_same_tokens(tiny, impl):
    exact = LLMEngine(model=tiny, block_size=4, kv_tokens=256, device="cpu", model_impl=impl)
    half = LLMEngine(model=tiny, block_size=4, kv_tokens=256, device="cpu", model_impl=impl,
                     kv_cache_dtype="bfloat16")
    assert exact.executor.runner.kv_pool.dtype == torch.float32
    assert half.executor.runner.kv_pool.dtype == torch.bfloat16
    assert half.executor.model.dtype == torch.float32
    assert half.info.kv.dtype == "bfloat16"
    assert half.info.kv.bytes_per_token * 2 == exact.info.kv.bytes_per_token
    assert greedy(half) == greedy(exact)


def test_default_is_the_model_dtype(tiny):
    assert LLMEngine(model=tiny, block_size=4, kv_tokens=64, device="cpu").info.kv.dtype == "float32"
    assert kv_cache_dtype_of("auto", "bfloat16", torch.device("cuda")) == "bfloat16"


def test_wrong_combinations_are_refused(tmp_path):
    make_tiny_model(tmp_path, "llama3")
    model, config = load_model(str(tmp_path))
    shape = (4, config.num_layers, 2, 4, config.num_kv_heads, config.head_dim)
    with pytest.raises(ValueError, match="--kv-cache-dtype"):
        ModelRunner(model, config, torch.zeros(shape), kv_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="--kv-cache-dtype"):
        ModelRunner(model, config, torch.zeros(shape, dtype=torch.float16), kv_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="--kv-cache-dtype float16 with --dtype bfloat16"):
        kv_cache_dtype_of("float16", "bfloat16", torch.device("cuda"))
    with pytest.raises(ValueError, match="--kv-cache-dtype: unsupported dtype 'int8'"):
        kv_cache_dtype_of("int8", "float32", torch.device("cpu"))
