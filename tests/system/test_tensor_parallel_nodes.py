"""A tensor-parallel group over two "nodes" on this host (issue 29): the executor service runs
rank 0 with `--tensor-parallel-nodes 2`, and a second `pagedserve executor` runs only rank
1, placed by LeaderWorkerSet's environment (LWS_LEADER_ADDRESS, LWS_GROUP_SIZE,
LWS_WORKER_INDEX) as in a worker pod, joining rank 0's rendezvous on a fixed port. Rank 1,
on another node, holds its own KV pool (pagedserve.memsvc.held_pools): memsvc keeps none for it,
preempts by recompute and sends the step's copy-on-write copies with it. Each test checks
the tokens against transformers' greedy ones:
- prefix caching, copy-on-write (n = 3) and recompute on a pool too small for the batch;
- when rank 0's executor stops, the worker node's process exits on its own (its pod
  restarts with the group), and memsvc holds nothing;
- rank 1 SIGKILLed mid-run: the group restarts (rank 0 by its supervisor, the node as its
  pod would), memsvc starts a new pool epoch (rank 1's pool died with it), the requests in
  flight finish with the same tokens by recompute, and nothing is left held."""
import os
import signal
import time

import pytest

from pagedserve.memsvc.config import MemoryConfig
from pagedserve.rpc.ports import free_port
from tests.support.gateway_harness import greedy
from tests.support.tp_services import BLOCK, NEW_TOKENS, PROMPTS, TPServices, run_all, tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp_nodes")
    return str(path), tiny_llama(path)


def two_nodes(path: str, num_blocks: int) -> TPServices:
    port = str(free_port())
    lws = {"LWS_LEADER_ADDRESS": "127.0.0.1", "LWS_GROUP_SIZE": "2", "PAGEDSERVE_TENSOR_PARALLEL_PORT": port}
    return TPServices(path, MemoryConfig(num_blocks=num_blocks, max_model_len=256),
                      executor_args=["--block-size", str(BLOCK), "--tensor-parallel-nodes", "2",
                                     "--tensor-parallel-host", "127.0.0.1", "--tensor-parallel-port", port],
                      gateway_args=["--max-num-seqs", "8"],
                      other_nodes=[dict(lws, LWS_WORKER_INDEX="1")])


def test_a_worker_node_holds_its_own_pool_through_prefix_caching_copy_on_write_and_recompute(tiny):
    path, expected = tiny
    s = two_nodes(path, num_blocks=24)  # 4 sequences of 39-45 tokens need 10-12 blocks each
    try:
        assert s.workers() == []  # rank 0's node launched no rank of its own: rank 1 is node 1's
        assert s.memory.manager.holds_pool == [False, True] and len(s.memory.manager.pools) == 1
        first = run_all(s, PROMPTS[:1])[0][0]
        assert first["token_ids"] == expected[tuple(PROMPTS[0])]
        again = run_all(s, PROMPTS[1:2])[0][0]  # the shared prefix's 3 full blocks are cached
        assert again["token_ids"] == expected[tuple(PROMPTS[1])] and again["usage"][2] >= 12
        [out] = run_all(s, PROMPTS[1:2], n=3)  # 18 prompt tokens: a partial last block, copied
        assert sorted(out) == [0, 1, 2]
        assert all(c["token_ids"] == expected[tuple(PROMPTS[1])] for c in out.values())
        outs = run_all(s, PROMPTS)
        assert [o[0]["token_ids"] for o in outs] == [expected[tuple(p)] for p in PROMPTS]
        snap = s.wait_unreferenced()
        assert snap["blocks_referenced"] == 0 and snap["prefix_cache_hits"] > 0
        assert snap["num_recomputed"] > 0 and snap["num_swapped_out"] == 0, snap
        [node] = s.nodes
        assert node.poll() is None
        s.sup.request_stop()  # rank 0 goes away: the worker node's rank fails and the node exits
        s._thread.join(30)
        s.sup.stop()
        deadline = time.monotonic() + 60
        while node.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert node.poll() is not None, "the worker node outlived its group"
    finally:
        s.close()


def test_the_rank_holding_its_pool_killed_mid_run_restarts_the_group_on_a_new_epoch(tiny):
    path, expected = tiny
    s = two_nodes(path, num_blocks=128)
    try:
        epoch = s.memory.manager.pool_epoch
        sampling = greedy(NEW_TOKENS, ignore_eos=True)
        streams = [s.generate(p, sampling) for p in PROMPTS]
        firsts = [list(next(stream).token_ids) for stream in streams]  # every request is running
        [rank1] = s.node_ranks(0)
        old_rank0 = s.executor.pid
        os.kill(rank1, signal.SIGKILL)
        s.restart_node(0)  # its node exits with the rank; its pod restarts
        got = [f + [t for r in stream for t in r.token_ids] for f, stream in zip(firsts, streams)]
        assert got == [expected[tuple(p)] for p in PROMPTS]
        assert s.executor.pid != old_rank0  # rank 0 went down with its group and was restarted
        assert s.memory.manager.pool_epoch != epoch  # the rank's new pool holds nothing
        assert [o[0]["token_ids"] for o in run_all(s, PROMPTS)] == [expected[tuple(p)] for p in PROMPTS]
        s.assert_nothing_held()
    finally:
        s.close()
