"""Tensor parallelism on this CPU (gloo, 2 processes): tiny random models split over 2 ranks
compute the logits of 1 rank within 1e-4 (observed ~1e-6: only the row-parallel sums are
added in another order) and greedy continuations equal transformers' token for token,
through the in-process engine with prefix caching, batched; KV heads replicated when there
are fewer than ranks; an odd vocabulary padded; a model that does not split says which
numbers; a killed rank puts the group down at once, without a hang. Every rank maps only
its own pool (memsvc holds one per rank)."""
import json
import time

import pytest
import torch

from pagedserve.executor import Executor
from pagedserve.executor.sharding import ShardPlan
from pagedserve.executor.tensor_parallel import GroupDown
from pagedserve.memsvc.config import MemoryConfig
from pagedserve.memsvc.memory_manager import MemoryManager
from pagedserve.cli import main
from pagedserve.engine import LLMEngine
from tests.support.tiny_models import hf_greedy_past_eos, make_tiny_model, paged_batches, save_tiny_tokenizer
from pagedserve.wire.protocol import SamplingParams

NEW_TOKENS = 24
LOGIT_TOLERANCE = 1e-4
MODELS = {
    "llama3": ("llama3", {}),
    "gqa_replicated": ("llama3", dict(num_key_value_heads=1, vocab_size=301)),  # 1 KV head, 2 ranks
    "mixtral": ("mixtral", {}),  # every expert split over the ranks
}


@pytest.fixture(scope="module", params=list(MODELS))
def model_dir(request, tmp_path_factory):
    arch, overrides = MODELS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    hf = make_tiny_model(path, arch, **overrides)
    save_tiny_tokenizer(path, vocab_size=overrides.get("vocab_size", 300))
    return request.param, path, hf


def step_logits(path, world: int) -> list[torch.Tensor]:
    chunks = [[("a", list(range(5, 17))), ("b", list(range(40, 47)))], [("a", [3]), ("b", [9])],
              [("a", [4]), ("b", list(range(60, 65)))]]
    ex = Executor(str(path), block_size=4, linear_backend="mkl", tensor_parallel_size=world)
    mem = shared_pools()
    try:
        ex.attach_pool(mem.register_executor(ex.kv_geometry(), ranks=world))
        return [ex.logits(b) for b in paged_batches(chunks, 4, 32)]
    finally:
        ex.close()
        mem.close()


def shared_pools() -> MemoryManager:
    """memsvc's manager with 32 blocks in shared memory (one segment per rank)."""
    return MemoryManager(MemoryConfig(num_blocks=32, shared=True, max_model_len=128))


def test_logits_close_to_one_rank(model_dir):
    _, path, _ = model_dir
    one, two = step_logits(path, 1), step_logits(path, 2)
    for a, b in zip(one, two):
        assert a.shape == b.shape
        assert (a - b).abs().max().item() < LOGIT_TOLERANCE


def test_greedy_matches_transformers(model_dir):
    _, path, hf = model_dir
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(3, 300, (9,), generator=g).tolist()
    prompts = [shared + torch.randint(3, 300, (n,), generator=g).tolist() for n in (5, 3, 8)]
    expected = hf_greedy_past_eos(hf, prompts, NEW_TOKENS)
    engine = LLMEngine(model=str(path), block_size=4, kv_tokens=1024, prefix_caching=True,
                       tensor_parallel_size=2, linear_backend="mkl")
    try:
        assert engine.info.kv.num_kv_heads == 2  # 2 split over 2 ranks, or 1 replicated on each
        sampling = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        assert [o.completions[0].token_ids for o in engine.generate(prompts, sampling)] == expected
        # one at a time: the shared prefix comes from the prefix cache
        again = [engine.generate([p], sampling)[0] for p in prompts]
        assert [o.completions[0].token_ids for o in again] == expected
        assert all(o.cached_tokens >= 8 for o in again)
        engine.memory.check_integrity()
    finally:
        engine.close()


def test_pagedserve_generate_two_ranks(tmp_path, capsys):
    make_tiny_model(tmp_path, "llama3")
    save_tiny_tokenizer(tmp_path)
    outs = []
    for n in ("1", "2"):
        rc = main(["generate", "--model", str(tmp_path), "--prompt", "w5 w6 w7 w8", "--max-tokens", "8",
                   "--ignore-eos", "--kv-tokens", "512", "--block-size", "4", "--device", "cpu",
                   "--json", "--tensor-parallel-size", n])
        captured = capsys.readouterr()
        assert rc == 0, captured.err
        outs.append(json.loads(captured.out.strip().splitlines()[-1])["token_ids"])
    assert outs[0] == outs[1] and len(outs[0]) == 8


@pytest.mark.parametrize("overrides, message", [
    (dict(hidden_size=48, num_attention_heads=3, num_key_value_heads=1), "num_attention_heads (3)"),
    (dict(hidden_size=192, num_attention_heads=12, num_key_value_heads=3, world=4),
     "num_key_value_heads (3) is fewer than the ranks"),
    (dict(intermediate_size=95), "intermediate_size (95)"),
])
def test_a_model_that_cannot_be_split_names_the_numbers(tmp_path, overrides, message):
    world = overrides.pop("world", 2)
    make_tiny_model(tmp_path, "llama3", **overrides)
    with pytest.raises(ValueError, match=r"tensor parallel size \d") as e:
        Executor(str(tmp_path), linear_backend="mkl", tensor_parallel_size=world)
    assert message in str(e.value) and str(world) in str(e.value)


def test_shard_plan_kv_heads():
    from pagedserve.executor.model_config import ModelConfig

    def config(heads, kv):
        return ModelConfig("LlamaForCausalLM", vocab_size=301, hidden_size=64, num_layers=1,
                           num_heads=heads, num_kv_heads=kv, head_dim=16, intermediate_size=96)

    split = [ShardPlan.of(config(8, 4), 2, r) for r in range(2)]
    assert [(p.heads, p.kv_heads, p.kv_start) for p in split] == [(4, 2, 0), (4, 2, 2)]
    replicated = [ShardPlan.of(config(8, 2), 4, r) for r in range(4)]
    assert [p.kv_start for p in replicated] == [0, 0, 1, 1] and replicated[0].group_kv_heads == 4
    assert [(p.vocab_start, p.vocab_per_rank) for p in split] == [(0, 151), (151, 151)]


def test_a_killed_rank_takes_the_group_down(tmp_path):
    make_tiny_model(tmp_path, "llama3")
    lost = []
    ex = Executor(str(tmp_path), block_size=4, linear_backend="mkl", tensor_parallel_size=2,
                  group_timeout=20, on_group_lost=lost.append)
    mem = shared_pools()
    try:
        ex.attach_pool(mem.register_executor(ex.kv_geometry(), ranks=2))
        batches = list(paged_batches([[("a", list(range(5, 17)))], [("a", [3])]], 4, 32))
        ex.execute(batches[0])
        worker = ex.leader.workers[0]
        with open(f"/proc/{worker.pid}/maps") as f:  # rank 1 maps its own pool only
            maps = f.read()
        assert mem.shms[1].name in maps and mem.shms[0].name not in maps
        worker.kill()
        start = time.monotonic()
        with pytest.raises(GroupDown, match="tensor-parallel group down"):
            for _ in range(50):  # the watch or the next collective notices, well before the timeout
                ex.execute(batches[1])
                time.sleep(0.1)
        assert time.monotonic() - start < 10
        deadline = time.monotonic() + 5
        while not lost and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lost and ("rank 1" in lost[0] or "collective" in lost[0])
    finally:
        ex.close()
        mem.close()
