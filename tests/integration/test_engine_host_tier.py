"""The prefix cache's host tier through the in-process engine on the default model: greedy
multi-turn chats on a pool too small for every history give identical outputs with
--kv-offload on and off, with fewer prompt tokens computed with it on, and memsvc holds
no block afterwards (issue 27)."""
from pagedserve.engine import LLMEngine
from pagedserve.engine_config import EngineConfig
from pagedserve.executor.config import ExecutorConfig
from pagedserve.memsvc.config import MemoryConfig
from pagedserve.wire.protocol import SamplingParams

SYSTEM = "You are a helpful assistant who answers briefly and precisely. " * 2
TOPICS = ["the history of sailing ships and the trade winds across the Atlantic",
          "how bread rises: yeast, gluten, water and the warmth of the kitchen",
          "the planets of the solar system, their moons and their rings"]
TURNS = ["Name a color.", "Why that one?", "And a second?"]


def chat(kv_offload: float):
    engine = LLMEngine(EngineConfig(
        executor=ExecutorConfig(block_size=16),
        # 14 blocks, 224 slots: about one conversation's history
        memory=MemoryConfig(kv_offload=kv_offload, preemption_mode="recompute", num_blocks=14)))
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    history = {c: engine.encode(f"{SYSTEM} Talk about {TOPICS[c]}. " * 3) for c in range(3)}
    outputs, computed = [], 0
    for turn in TURNS:
        prompts = [history[c] + engine.encode(f" User: {turn} Assistant:") for c in range(3)]
        for c, out in enumerate(engine.generate(prompts, greedy)):
            tokens = out.completions[0].token_ids
            outputs.append(tokens)
            computed += out.prompt_tokens - out.cached_tokens
            history[c] = prompts[c] + tokens
    engine.memory.check_integrity()
    stats = engine.memory.stats()
    assert stats.snapshot["blocks_referenced"] == 0 and stats.num_sequences == 0
    return outputs, computed, stats.preemption


def test_the_host_tier_changes_no_output_and_computes_fewer_prompt_tokens():
    off, off_computed, off_stats = chat(0.0)
    on, on_computed, on_stats = chat(0.05)  # ~70 blocks of 720 KiB
    assert on == off
    assert off_stats["host_tier_blocks"] == 0 and on_stats["host_tier_restored"] > 0
    assert on_computed < off_computed
