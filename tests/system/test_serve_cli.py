"""`pagedserve serve` as a real process tree: it says where it serves, restarts a crashed
executor, and SIGTERM leaves no process and no shared-memory segment behind."""
import os
import signal
import subprocess
import time

import grpc

from pagedserve.client import GenerationClient
from pagedserve.wire.protocol import SamplingParams
from tests.support.serve_procs import TOKEN, alive, children, cmdline, free_port, segments, start, stop


def read_line(proc, timeout=300.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line:
            return line
        if proc.poll() is not None:
            raise RuntimeError(f"serve exited with {proc.returncode}")
    raise TimeoutError("serve printed nothing")


def generate(address: str) -> str:
    with GenerationClient(address, timeout=120) as c:
        return "".join(d.text for d in c.generate("The capital of France is",
                                                  SamplingParams(max_tokens=4, temperature=0)))


def test_serve_restarts_a_crash_and_stops_cleanly_on_sigterm():
    port, mem_port, ex_port = free_port(), free_port(), free_port()
    proc = start("serve", "--port", str(port), "--memsvc-port", str(mem_port),
                 "--executor-port", str(ex_port), "--kv-tokens", "1024", "--max-num-seqs", "4",
                 "--http-port", "0",
                 stdout=subprocess.PIPE)
    pids = []
    try:
        line = read_line(proc)
        assert line.strip() == f"pagedserve: serving SmolLM2-135M-Instruct on 127.0.0.1:{port}"
        address = f"127.0.0.1:{port}"
        first = generate(address)
        assert first
        pids = children(proc.pid)
        assert len(pids) == 3 and all(alive(p) for p in pids)
        assert len(segments(pids)) == 1

        [executor] = [p for p in pids if "executor" in cmdline(p)]
        os.kill(executor, signal.SIGKILL)
        deadline = time.monotonic() + 300
        again = None
        while time.monotonic() < deadline and again is None:
            try:
                again = generate(address)
            except grpc.RpcError:
                time.sleep(0.5)
        assert again == first
        pids = sorted(set(pids) | set(children(proc.pid)))

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert not [p for p in pids if alive(p)]
        assert segments(pids) == []
    finally:
        stop([proc])
        for p in pids:
            if alive(p):
                os.kill(p, signal.SIGKILL)


def test_serve_takes_every_memsvc_flag_and_swaps_under_a_tiny_pool():
    """The command the restructuring issue quoted, refused before: `serve` copied flags by hand."""
    from concurrent.futures import ThreadPoolExecutor

    from pagedserve.rpc.grpc_service import open_channel
    from pagedserve.wire.v1 import memory_pb2, memory_pb2_grpc

    port, mem_port = free_port(), free_port()
    proc = start("serve", "--preemption-mode", "swap", "--swap-space", "1", "--kv-tokens", "160",
                 "--port", str(port), "--memsvc-port", str(mem_port), "--http-port", "0",
                 stdout=subprocess.PIPE)
    prompts = [f"Story {i}: once upon a time, in a land far away, there lived a" for i in range(4)]

    def run(prompt):
        with GenerationClient(f"127.0.0.1:{port}", timeout=300) as c:
            return "".join(d.text for d in c.generate(prompt, SamplingParams(
                max_tokens=40, temperature=0, ignore_eos=True)))
    try:
        assert read_line(proc).startswith("pagedserve: serving ")
        alone = [run(p) for p in prompts]
        with ThreadPoolExecutor(len(prompts)) as pool:  # 4 x ~60 tokens > 160 slots: preemption
            together = list(pool.map(run, prompts))
        assert together == alone and all(alone)
        with open_channel(f"127.0.0.1:{mem_port}", token=TOKEN) as channel:
            stats = memory_pb2_grpc.MemoryManagerStub(channel).Stats(memory_pb2.StatsRequest(), timeout=10)
        assert stats.preemption_mode == "swap" and stats.num_blocks == 10
        assert stats.num_swapped_out > 0 and stats.num_swapped_in == stats.num_swapped_out
        assert stats.blocks_referenced == 0
    finally:
        stop([proc])
