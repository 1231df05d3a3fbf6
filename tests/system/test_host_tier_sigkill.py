"""memsvc SIGKILL with a populated host tier (--kv-offload) under `pagedserve serve` (real
model, real processes; issue 27): the tier is lost with the process (the new memsvc's Stats
show it empty), and nothing is served wrong: every request, before and after the kill and
with one killed mid-generation, gets the tokens of a run on a fresh server."""
import os
import signal
import time

import grpc
import pytest

from pagedserve.wire.v1 import generation_pb2 as pb
from pagedserve.wire.v1 import memory_pb2
from tests.support.gateway_harness import greedy
from tests.support.serve_procs import alive, children, cmdline, serving_grpc

WORDS = ("river", "lantern", "copper", "meadow", "signal", "harbor", "velvet", "orbit", "thunder",
         "pepper", "garden", "marble")
# distinct from the first token: no prefix shared between them, ~100 tokens each
PROMPTS = [f"Story {i}: " + " ".join(WORDS[(i + j * 5) % len(WORDS)] for j in range(80))
           for i in range(4)]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def served():
    with serving_grpc("--kv-tokens", "256", "--kv-offload", "0.1", "--max-num-seqs", "4") as served:
        yield served


def generate(served, prompt: str) -> list[int]:
    stream = served["stub"].Generate(pb.GenerateRequest(
        prompt=prompt, sampling=greedy(MAX_TOKENS, ignore_eos=True)), timeout=300)
    return [t for r in stream for t in r.token_ids]


def stats(served, timeout: float = 60.0) -> memory_pb2.StatsResponse:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return served["memory"].Stats(memory_pb2.StatsRequest(), timeout=5)
        except grpc.RpcError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def unreferenced(served, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while stats(served).blocks_referenced:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def memsvc_pid(served) -> int | None:
    pids = [p for p in children(served["proc"].pid) if alive(p) and "memsvc" in cmdline(p)]
    served["pids"].update(pids)
    return pids[0] if len(pids) == 1 else None


def test_a_killed_memsvc_loses_its_tier_and_serves_nothing_wrong(served):
    first = [generate(served, p) for p in PROMPTS]  # on a pool of 16 blocks: each evicts the last
    again = [generate(served, p) for p in PROMPTS]  # their prefixes come back from the tier
    assert again == first
    s = stats(served)
    assert s.host_tier_blocks > 0 and s.host_tier_offloaded > 0, "the tier was never populated"
    assert s.host_tier_restored > 0 and s.host_tier_tokens_restored > 0
    assert s.host_tier_blocks_used > 0

    old = memsvc_pid(served)
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while memsvc_pid(served) in (old, None):
        assert time.monotonic() < deadline, "memsvc was not restarted"
        time.sleep(0.2)
    probe = "A short question about something else entirely?"
    assert generate(served, probe)  # the executor registers with the new memsvc
    fresh = stats(served)
    assert (fresh.host_tier_offloaded, fresh.host_tier_restored, fresh.host_tier_blocks_used) == (0, 0, 0)
    assert fresh.host_tier_blocks == s.host_tier_blocks

    # the same prompts on the new memsvc: recomputed, then restored from its own tier
    assert [generate(served, p) for p in PROMPTS] == first
    assert [generate(served, p) for p in PROMPTS] == first
    assert unreferenced(served)


def test_a_kill_mid_generation_with_a_populated_tier_keeps_the_outputs(served):
    reference = [generate(served, p) for p in PROMPTS]
    for _ in range(3):  # the cost model offloads only when a copy beats recompute, timed under this load
        if stats(served).host_tier_blocks_used > 0:
            break
        assert [generate(served, p) for p in PROMPTS] == reference
    if stats(served).host_tier_blocks_used == 0:
        pytest.skip("the cost model offloaded nothing under this load: no populated tier to kill")
    streams = [served["stub"].Generate(pb.GenerateRequest(
        prompt=p, sampling=greedy(MAX_TOKENS, ignore_eos=True)), timeout=300) for p in PROMPTS]
    firsts = [list(next(s).token_ids) for s in streams]
    os.kill(memsvc_pid(served), signal.SIGKILL)
    got = [f + [t for r in s for t in r.token_ids] for f, s in zip(firsts, streams)]
    assert got == reference
    assert unreferenced(served)
