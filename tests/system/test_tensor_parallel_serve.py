"""`pagedserve serve --tensor-parallel-size 2` as real processes on this CPU (gloo): greedy
output equal to transformers through memsvc, the executor group and the gateway; a rank
SIGKILLed takes its group down (the executor exits, no rank waits in a collective), the
supervisor restarts the whole group on the pool memsvc kept, and the same prompts give the
same tokens; SIGTERM leaves no process and no shared-memory segment."""
import os
import signal
import subprocess
import time

import grpc
import pytest

from pagedserve.client import GenerationClient
from tests.support.serve_procs import alive, children, cmdline, free_port, segments, start, stop
from tests.support.tiny_models import hf_greedy_past_eos, make_tiny_model, save_tiny_tokenizer
from pagedserve.wire.protocol import SamplingParams

NEW_TOKENS = 16
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42, 5, 6]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp_llama")
    hf = make_tiny_model(path, "llama3", num_key_value_heads=1)  # its KV head replicated on both ranks
    save_tiny_tokenizer(path)
    expected = hf_greedy_past_eos(hf, PROMPTS, NEW_TOKENS)
    return path, expected


def generate_all(address: str) -> list[list[int]]:
    sampling = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    with GenerationClient(address, timeout=120) as c:
        return [[t for d in c.generate(p, sampling) for t in d.token_ids] for p in PROMPTS]


def descendants(pid: int) -> list[int]:
    out = []
    for c in children(pid):
        out += [c, *descendants(c)]
    return out


def workers(pid: int) -> list[int]:
    return [p for p in descendants(pid) if any("pagedserve.executor.tp_worker" in a for a in cmdline(p))]


def test_serve_two_ranks_greedy_and_a_killed_rank(tiny):
    path, expected = tiny
    port = free_port()
    proc = start("serve", "--model", str(path), "--tensor-parallel-size", "2", "--port", str(port),
                 "--kv-tokens", "1024", "--block-size", "4", "--device", "cpu",
                 "--linear-backend", "mkl", "--http-port", "0", stdout=subprocess.PIPE)
    pids = []
    try:
        assert "pagedserve: serving" in proc.stdout.readline()
        address = f"127.0.0.1:{port}"
        assert generate_all(address) == expected
        [worker] = workers(proc.pid)
        pids = descendants(proc.pid)
        os.kill(worker, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not [p for p in workers(proc.pid) if p != worker]:
            time.sleep(0.2)
        assert [p for p in workers(proc.pid) if p != worker], "the group did not restart"
        again = None
        while time.monotonic() < deadline and again is None:
            try:
                again = generate_all(address)
            except grpc.RpcError:
                time.sleep(0.5)
        assert again == expected
        pids = sorted(set(pids) | set(descendants(proc.pid)))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and [p for p in pids if alive(p)]:
            time.sleep(0.2)
        assert not [p for p in pids if alive(p)]
        assert segments(pids) == []
    finally:
        stop([proc])
        for p in pids:
            if alive(p):
                os.kill(p, signal.SIGKILL)
