"""Teacher-forced logits through the paged path match transformers on the same weights."""
import pytest
import torch

from tests.support.tiny_models import TINY_ARCHS, make_tiny_model, paged_batches
from pagedserve.executor.model_loader import load_model
from pagedserve.executor.model_runner import ModelRunner

TOL = 1e-3


def schedule(prompts: dict[str, list[int]]):
    """Steps mixing chunked prefill and decode: 'a' prefills in two chunks then decodes,
    'b' joins in step 2 with its whole prompt, 'c' prefills in three chunks."""
    a, b, c = prompts["a"], prompts["b"], prompts["c"]
    na = len(a) - 3
    return [
        [("a", a[:na // 2]), ("c", c[:5])],
        [("c", c[5:11]), ("a", a[na // 2:na]), ("b", b[:-2])],
        [("a", a[na:na + 1]), ("b", b[-2:-1]), ("c", c[11:])],
        [("b", b[-1:]), ("a", a[na + 1:na + 2])],
        [("a", a[na + 2:])],
    ]


def run_paged(runner, steps, block_size, num_blocks):
    got: dict[str, list[torch.Tensor]] = {}
    for batch in paged_batches(steps, block_size, num_blocks, seed=1):
        logits, starts = runner.logits(batch), batch.starts
        assert logits.shape[0] == starts[-1] == len(batch.token_ids)
        for i, seq_id in enumerate(batch.seq_ids):
            got.setdefault(seq_id, []).append(logits[starts[i]:starts[i + 1]])
    return {k: torch.cat(v) for k, v in got.items()}


def check_against_hf(hf, runner, prompts, block_size, num_blocks, tol=TOL):
    got = run_paged(runner, schedule(prompts), block_size, num_blocks)
    worst = 0.0
    for seq_id, ids in prompts.items():
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].float()
        assert got[seq_id].shape == ref.shape
        worst = max(worst, (got[seq_id] - ref).abs().max().item())
    assert worst <= tol, f"max abs logit difference {worst}"
    return worst


CASES = [("llama3", False), ("llama3", True), ("llama_bias", False), ("mistral", True),
         ("qwen2", False), ("qwen2", True), ("qwen3", False), ("qwen3", True),
         ("mistral_swa", False), ("qwen2_swa", True), ("gemma2", True), ("gemma3", True),
         ("phi3", False), ("mixtral", False)]


@pytest.mark.parametrize("arch,tie", CASES, ids=[f"{a}-{'tied' if t else 'untied'}" for a, t in CASES])
def test_tiny_models_match_transformers(tmp_path, arch, tie):
    assert arch in TINY_ARCHS
    hf = make_tiny_model(tmp_path, arch, tie=tie)
    model, config = load_model(str(tmp_path))
    assert config.tie_word_embeddings == tie
    block_size, num_blocks = 4, 48
    pool = torch.zeros(num_blocks, config.num_layers, 2, block_size, config.num_kv_heads, config.head_dim)
    runner = ModelRunner(model, config, pool)
    g = torch.Generator().manual_seed(3)
    # 'a' is long enough (40 > 16) to reach the llama3-scaled rotary frequencies' band.
    prompts = {k: torch.randint(0, config.vocab_size, (n,), generator=g).tolist()
               for k, n in (("a", 40), ("b", 9), ("c", 23))}
    check_against_hf(hf, runner, prompts, block_size, num_blocks)


def test_bfloat16_close_to_transformers(tmp_path):
    make_tiny_model(tmp_path, "qwen3")
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.bfloat16)
    model, config = load_model(str(tmp_path), dtype="bfloat16")
    pool = torch.zeros(32, config.num_layers, 2, 8, config.num_kv_heads, config.head_dim,
                       dtype=torch.bfloat16)
    runner = ModelRunner(model, config, pool)
    prompts = {"a": list(range(5, 25)), "b": list(range(40, 50)), "c": list(range(100, 117))}
    check_against_hf(hf, runner, prompts, 8, 32, tol=0.1)


def test_pool_must_fit_the_model(tmp_path):
    make_tiny_model(tmp_path, "mistral")
    model, config = load_model(str(tmp_path))
    with pytest.raises(ValueError, match="KV pool shape"):
        ModelRunner(model, config, torch.zeros(4, config.num_layers, 2, 4, 3, config.head_dim))
    with pytest.raises(ValueError, match="dtype"):
        ModelRunner(model, config, torch.zeros(4, config.num_layers, 2, 4, config.num_kv_heads,
                                               config.head_dim, dtype=torch.bfloat16))


PROMPTS = [
    "<|im_start|>user\nWhat is a paged KV cache?<|im_end|>\n<|im_start|>assistant\n",
    "The quick brown fox jumps over the lazy dog. Then the dog",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
]


def test_mixture_of_experts_runs_without_cuda_graphs(tmp_path):
    """Mixtral's per-expert split reads the routing on the host, which a CUDA graph cannot
    capture: DecodeGraphs declines it even for a CUDA pool."""
    from pagedserve.executor.cuda_graphs import DecodeGraphs

    make_tiny_model(tmp_path, "mixtral")
    model, config = load_model(str(tmp_path))

    class CudaPool:  # stands for a CUDA pool: for_pool must decline before touching it
        is_cuda = True

    assert DecodeGraphs.for_pool(model, config, CudaPool()) is None
