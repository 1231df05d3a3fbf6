"""Tensor parallelism across ranks through the split services (issue 29): memsvc (in this
process, so its integrity check runs here), `pagedserve executor --tensor-parallel-size 2`
(gloo, a tiny random Llama whose 2 KV heads are split, one per rank) and a gateway, as
processes. Every memsvc decision is rank-agnostic and every block copy must reach every
rank's KV heads; each test compares the tokens with transformers' greedy ones:
- prefix caching: a second request with the same prefix reports cached tokens, same output;
- copy-on-write: n = 3 completions of a prompt whose last block is partial, all the same;
- preemption by swap and by recompute on a pool too small for the batch (memsvc's counters
  say it happened), outputs those of the unpressured model;
- a rank SIGKILLed mid-run: the executor group restarts on the pool memsvc kept, the
  requests in flight finish with the same tokens, memsvc's integrity check is clean and
  no block or sequence is left held."""
import os
import signal

import pytest

from pagedserve.memsvc.config import MemoryConfig
from tests.support.gateway_harness import greedy
from tests.support.tp_services import BLOCK, NEW_TOKENS, PROMPTS, TPServices, run_all, tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp_services")
    return str(path), tiny_llama(path)


def services(path: str, **memory) -> TPServices:
    config = MemoryConfig(**{"num_blocks": 256, "max_model_len": 256, "num_host_blocks": 128, **memory})
    return TPServices(path, config, executor_args=["--block-size", str(BLOCK)],
                      gateway_args=["--max-num-seqs", "8"])


@pytest.fixture(scope="module")
def roomy(tiny):
    s = services(tiny[0])
    yield s
    s.close()


def test_prefix_cache_across_ranks(tiny, roomy):
    _, expected = tiny
    first = run_all(roomy, PROMPTS[:1])[0][0]
    assert first["token_ids"] == expected[tuple(PROMPTS[0])]
    for p in PROMPTS[1:]:  # one at a time: each finds the shared prefix's 3 full blocks
        out = run_all(roomy, [p])[0][0]
        assert out["token_ids"] == expected[tuple(p)]
        assert out["usage"][2] >= 12, out["usage"]
    again = run_all(roomy, PROMPTS[:1])[0][0]
    assert again["token_ids"] == first["token_ids"] and again["usage"][2] >= 12
    snap = roomy.wait_unreferenced()
    assert snap["blocks_referenced"] == 0 and snap["prefix_cache_hits"] > 0


def test_copy_on_write_with_n_completions(tiny, roomy):
    _, expected = tiny
    outs = run_all(roomy, PROMPTS[1:3], n=3)  # 18 and 16 prompt tokens: a partial last block
    for p, out in zip(PROMPTS[1:3], outs):
        assert sorted(out) == [0, 1, 2]
        assert all(c["token_ids"] == expected[tuple(p)] for c in out.values())
    assert roomy.wait_unreferenced()["blocks_referenced"] == 0


@pytest.mark.parametrize("mode, counter", [("swap", "num_swapped_out"), ("recompute", "num_recomputed")])
def test_preemption_across_ranks(tiny, mode, counter):
    path, expected = tiny
    # 4 sequences of 39-45 tokens need 10-12 blocks each; 24 blocks hold two at a time
    s = services(path, num_blocks=24, preemption_mode=mode)
    try:
        outs = run_all(s, PROMPTS)
        assert [o[0]["token_ids"] for o in outs] == [expected[tuple(p)] for p in PROMPTS]
        snap = s.wait_unreferenced()
        assert snap[counter] > 0, f"no preemption by {mode}: {snap}"
        assert snap["blocks_referenced"] == 0
    finally:
        s.close()


def test_a_rank_killed_mid_run_restarts_the_group_and_leaks_nothing(tiny):
    path, expected = tiny
    s = services(path)
    try:
        sampling = greedy(NEW_TOKENS, ignore_eos=True)
        streams = [s.generate(p, sampling) for p in PROMPTS]
        firsts = [list(next(stream).token_ids) for stream in streams]  # every request is running
        [worker] = s.workers()
        os.kill(worker, signal.SIGKILL)
        got = [f + [t for r in stream for t in r.token_ids] for f, stream in zip(firsts, streams)]
        assert got == [expected[tuple(p)] for p in PROMPTS]
        s.wait_restarted([worker])
        assert [o[0]["token_ids"] for o in run_all(s, PROMPTS)] == [expected[tuple(p)] for p in PROMPTS]
        s.assert_nothing_held()
    finally:
        s.close()
