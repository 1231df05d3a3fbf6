"""A tensor-parallel group over two "nodes" on this host (issue 29): the executor service runs
rank 0 with `--tensor-parallel-nodes 2`, and a second `pagedserve executor` runs only rank
1, placed by LeaderWorkerSet's environment (LWS_LEADER_ADDRESS, LWS_GROUP_SIZE,
LWS_WORKER_INDEX) as in a worker pod, joining rank 0's rendezvous on a fixed port. Greedy
output through memsvc and a gateway equals transformers'; when rank 0's executor stops, the
worker node's process exits on its own (its pod restarts with the group), and memsvc holds
nothing."""
import time


from memsvc.config import MemoryConfig
from pagedserve.serve_cmd import free_port
from tests.support.gateway_harness import collect, greedy
from tests.support.tiny_models import hf_greedy_past_eos, make_tiny_model, save_tiny_tokenizer
from tests.support.tp_services import TPServices

NEW_TOKENS = 16
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42, 5, 6]]


def test_a_worker_node_placed_by_leaderworkerset_env_joins_the_group(tmp_path):
    hf = make_tiny_model(tmp_path, "llama3")
    save_tiny_tokenizer(tmp_path)
    expected = hf_greedy_past_eos(hf, PROMPTS, NEW_TOKENS)
    port = str(free_port())
    lws = {"LWS_LEADER_ADDRESS": "127.0.0.1", "LWS_GROUP_SIZE": "2", "PAGEDSERVE_TENSOR_PARALLEL_PORT": port}
    s = TPServices(str(tmp_path), MemoryConfig(num_blocks=128, max_model_len=256),
                   executor_args=["--block-size", "4", "--tensor-parallel-nodes", "2",
                                  "--tensor-parallel-host", "127.0.0.1", "--tensor-parallel-port", port],
                   other_nodes=[dict(lws, LWS_WORKER_INDEX="1")])
    try:
        assert s.workers() == []  # rank 0's node launched no rank of its own: rank 1 is node 1's
        sampling = greedy(NEW_TOKENS, ignore_eos=True)
        outs = [collect(s.generate(p, sampling))[0]["token_ids"] for p in PROMPTS]
        assert outs == expected
        assert s.wait_unreferenced()["blocks_referenced"] == 0
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
