"""`pagedserve serve` as a real process tree: it says where it serves, restarts a crashed
executor, and SIGTERM leaves no process and no shared-memory segment behind."""
import os
import signal
import subprocess
import time

import grpc

from pagedserve.client import GenerationClient
from wire.protocol import SamplingParams
from tests.support.serve_procs import alive, children, cmdline, free_port, segments, start, stop


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
