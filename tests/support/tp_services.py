"""The split services around a tensor-parallel executor group, for the TP system tests: memsvc
in this process (its real gRPC service, so a test can run its integrity check under its
lock), the executor group and the gateway as `pagedserve executor` / `pagedserve gateway`
processes under a pagedserve Supervisor (a crashed executor group restarts as under `serve`).
`other_nodes` starts, first, one more `pagedserve executor` per environment given (e.g.
LeaderWorkerSet's variables for a worker pod), each running only its node's ranks
(`restart_node` starts one again once it exited, as its pod would restart). All of them
take the internal token tests.support.serve_procs.TOKEN. Always stopped; `pids` collects
every process started, the workers of each group included."""
from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import torch

from pagedserve.memsvc.config import MemoryConfig
from pagedserve.memsvc.memory_manager import MemoryManager
from pagedserve.memsvc.server import SERVICE_NAME, MemoryService
from pagedserve.rpc import internal_auth
from pagedserve.rpc.grpc_service import Service
from pagedserve.rpc.ports import free_port
from pagedserve.serve_cmd import GENERATION
from pagedserve.supervisor import ServiceSpec, Supervisor
from pagedserve.wire.v1 import generation_pb2 as pb
from pagedserve.wire.v1 import generation_pb2_grpc, memory_pb2_grpc
from tests.support import ROOT
from tests.support.gateway_harness import collect, greedy
from tests.support.serve_procs import TOKEN, TOKEN_ENV, alive, children, cmdline
from tests.support.tiny_models import make_tiny_model, save_tiny_tokenizer

CLI = [sys.executable, "-m", "pagedserve.cli"]
BLOCK = 4
NEW_TOKENS = 24
_G = torch.Generator().manual_seed(11)
PREFIX = torch.randint(3, 300, (13,), generator=_G).tolist()
# a shared 13-token prefix (3 full blocks of 4), then 2-6 tokens each
PROMPTS = [PREFIX + torch.randint(3, 300, (n,), generator=_G).tolist() for n in (2, 5, 3, 6)]


def tiny_llama(path) -> dict[tuple, list[int]]:
    """A tiny random Llama (4 query heads, 2 KV heads: one per rank of 2) and its tokenizer
    saved at `path`; transformers' greedy NEW_TOKENS for each of PROMPTS, past EOS."""
    hf = make_tiny_model(path, "llama3")
    save_tiny_tokenizer(path)
    hf.generation_config.eos_token_id = None
    expected = {}
    for p in PROMPTS:
        with torch.inference_mode():
            y = hf.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        expected[tuple(p)] = y[0, len(p):].tolist()
    return expected


def run_all(s: "TPServices", prompts, n: int = 1) -> list[dict]:
    """Greedy NEW_TOKENS for each prompt (n completions each), all in flight together."""
    sampling = greedy(NEW_TOKENS, ignore_eos=True, n=n)
    streams = [s.generate(p, sampling) for p in prompts]
    return [collect(stream) for stream in streams]


def descendants(pid: int) -> list[int]:
    out = []
    for c in children(pid):
        out += [c, *descendants(c)]
    return out


class TPServices:
    """memsvc (in process) + `pagedserve executor --tensor-parallel-size N` + a gateway."""

    def __init__(self, model: str, memory: MemoryConfig, world: int = 2, executor_args=(),
                 gateway_args=(), other_nodes: list[dict[str, str]] = ()):
        self.memory = MemoryService(MemoryManager(dataclasses.replace(memory, shared=True)))
        self.service = Service([SERVICE_NAME], max_workers=16, interceptors=internal_auth.interceptors(TOKEN))
        memory_pb2_grpc.add_MemoryManagerServicer_to_server(self.memory, self.service.server)
        mem_address = self.service.start("127.0.0.1", 0)
        self.service.set_serving(True)
        ex_port, gw_port = free_port(), free_port()
        env = {"PYTHONPATH": ROOT, "PAGEDSERVE_HTTP_PORT": "0", TOKEN_ENV: TOKEN}
        executor = [*CLI, "executor", "--model", model, "--port", str(ex_port), "--memsvc",
                    mem_address, "--tensor-parallel-size", str(world), "--device", "cpu",
                    "--linear-backend", "mkl", "--tensor-parallel-timeout", "30", *executor_args]
        gateway = [*CLI, "gateway", "--port", str(gw_port), "--memsvc", mem_address, "--executor",
                   f"127.0.0.1:{ex_port}", "--http-port", "0", *gateway_args]
        node = [*CLI, "executor", "--model", model, "--tensor-parallel-size", str(world), "--device",
                "cpu", "--linear-backend", "mkl", "--tensor-parallel-timeout", "30", *executor_args]
        self._node_runs = [(node, dict(os.environ, **env, **node_env)) for node_env in other_nodes]
        self.nodes = [subprocess.Popen(cmd, cwd=ROOT, env=node_env) for cmd, node_env in self._node_runs]
        self.sup = Supervisor([ServiceSpec("executor", executor, f"127.0.0.1:{ex_port}", env=env),
                               ServiceSpec("gateway", gateway, f"127.0.0.1:{gw_port}",
                                           health_service=GENERATION, env=env)],
                              log=lambda m: print(f"tp-services: {m}", file=sys.stderr, flush=True))
        self.pids: set[int] = {p.pid for p in self.nodes}
        self._thread = None
        try:
            self.sup.start()
        except BaseException:
            self.close()
            raise
        self._thread = threading.Thread(target=self.sup.run, daemon=True, name="tp-supervisor")
        self._thread.start()
        self.channel = grpc.insecure_channel(f"127.0.0.1:{gw_port}")
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)

    @property
    def executor(self):
        return self.sup.by_name["executor"].proc

    def workers(self) -> list[int]:
        """The tp_worker processes of the running executor group."""
        proc = self.executor
        found = [p for p in descendants(proc.pid) if any("pagedserve.executor.tp_worker" in a for a in cmdline(p))]
        self.pids.update(found)
        return found

    def generate(self, prompt: list[int], sampling: pb.SamplingParams, timeout: float = 300):
        return self.stub.Generate(pb.GenerateRequest(prompt_token_ids=prompt, sampling=sampling),
                                  timeout=timeout)

    def check_integrity(self) -> dict:
        """memsvc's integrity check (IntegrityError when broken) and its stats, under its lock."""
        with self.memory.lock:
            self.memory.manager.check_integrity()
            st = self.memory.manager.stats()
        return {**st.snapshot, **st.preemption, "prefix_cache_hits": st.prefix_cache_hits,
                "num_sequences": st.num_sequences}

    def wait_unreferenced(self, timeout: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            snap = self.check_integrity()
            if snap["blocks_referenced"] == 0 or time.monotonic() > deadline:
                return snap
            time.sleep(0.1)

    def assert_nothing_held(self) -> dict:
        """memsvc holds no sequence and every block is free or cached; its stats."""
        snap = self.wait_unreferenced()
        assert (snap["blocks_referenced"], snap["num_sequences"]) == (0, 0), snap
        assert snap["blocks_free"] + snap["blocks_cached"] == snap["num_blocks"], snap
        return snap

    def restart_node(self, i: int, timeout: float = 60.0) -> None:
        """Once worker node i has exited (its group went down), start it again, as its pod's
        restart would."""
        deadline = time.monotonic() + timeout
        while self.nodes[i].poll() is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"worker node {i} did not exit with its group")
            time.sleep(0.2)
        self.pids.update(descendants(self.nodes[i].pid))
        cmd, env = self._node_runs[i]
        self.nodes[i] = subprocess.Popen(cmd, cwd=ROOT, env=env)
        self.pids.add(self.nodes[i].pid)

    def node_ranks(self, i: int) -> list[int]:
        """The tp_worker processes worker node i runs."""
        found = [p for p in descendants(self.nodes[i].pid)
                 if any("pagedserve.executor.tp_worker" in a for a in cmdline(p))]
        self.pids.update(found)
        return found

    def wait_restarted(self, old_workers: list[int], timeout: float = 180.0) -> None:
        """Until the executor group runs again with new workers and says SERVING."""
        from pagedserve.supervisor import health_status

        deadline = time.monotonic() + timeout
        spec = self.sup.by_name["executor"].spec
        while time.monotonic() < deadline:
            new = [p for p in self.workers() if p not in old_workers]
            if new and health_status(spec.address) == 1:  # SERVING
                return
            time.sleep(0.2)
        raise TimeoutError("the tensor-parallel executor group did not restart")

    def close(self) -> None:
        for r in self.sup.services:
            if r.proc is not None:
                self.pids.add(r.proc.pid)
                self.pids.update(descendants(r.proc.pid))
        self.sup.request_stop()
        if self._thread is not None:
            self._thread.join(30)
        self.sup.stop()
        if hasattr(self, "channel"):
            self.channel.close()
        for node in self.nodes:
            self.pids.update(descendants(node.pid))
            if node.poll() is None:
                node.terminate()
            try:
                node.wait(20)
            except subprocess.TimeoutExpired:
                node.kill()
                node.wait()
        self.service.stop(0)
        self.memory.close()
        for p in self.pids:
            if alive(p):
                os.kill(p, signal.SIGKILL)
