"""`pagedserve bench split`: split services against the in-process engine on the same workload.

Three runs of the same requests (greedy, ignore_eos, all submitted at once):
- gateway: memsvc, executor and gateway as processes; clients stream through the public API.
- split loop: the batching loop in this process over the gRPC clients of memsvc and the
  executor, each call timed, so a step's reserve and execute times include their RPCs; as
  the gateway runs it (while a step runs: the last step's outputs handled, the next step
  planned and reserved), then serially, then with the outputs overlapped only.
- in process: the offline engine, the same loop over direct calls, each call timed.
Per-step RPC overhead is the split loop's step time minus the in-process one. Each run
(and each warm-up) gets its own fresh random prompts, so no run finds another's prompt
blocks in the prefix cache (the split loop shares memsvc with the gateway run before it).
"""
from __future__ import annotations

import json
import os
import random
import threading
import time
from collections import defaultdict

from wire.clients import ExecutorClient, MemoryClient
from wire.protocol import ModelInfo, Plan, PoolStats, ReserveResult, SampleOutput, SamplingParams, StepBatch
from benchmarks.workloads import random_prompt_ids


def add_parser(sub) -> None:
    from pagedserve.engine_config import add_engine_flags

    p = sub.add_parser("split", help="split services vs the in-process engine: throughput and RPC time",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--input-len", type=int, default=64, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=64, help="output tokens per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_results/split.json", help="JSON results file")
    add_engine_flags(p)
    p.set_defaults(run=run)


class _Timed:
    """Wraps a client; every call's wall time is added up by method name."""

    def __init__(self, inner):
        self.inner = inner
        self.seconds: dict[str, float] = defaultdict(float)

    def _timed(self, name: str, fn, *args):
        t = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.seconds[name] += time.perf_counter() - t


class TimedMemory(_Timed, MemoryClient):
    def reserve(self, plan: Plan) -> ReserveResult:
        return self._timed("reserve", self.inner.reserve, plan)

    def free(self, seq_ids: list[str]) -> None:
        self._timed("free", self.inner.free, seq_ids)

    def fork(self, parent_id: str, child_id: str) -> None:
        self._timed("fork", self.inner.fork, parent_id, child_id)

    def stats(self) -> PoolStats:
        return self._timed("stats", self.inner.stats)


class TimedExecutor(_Timed, ExecutorClient):
    def model_info(self) -> ModelInfo:
        return self._timed("model_info", self.inner.model_info)

    def execute(self, batch: StepBatch) -> list[SampleOutput]:
        return self._timed("execute", self.inner.execute, batch)


def drive(loop, prompts: list[list[int]], sampling: SamplingParams) -> dict:
    """Run every prompt through a BatchLoop whose clients are timed; return the step numbers."""
    memory, executor = loop.memory, loop.executor
    memory.seconds.clear()
    executor.seconds.clear()
    for i, p in enumerate(prompts):
        loop.add_request(f"bench-{i}", p, sampling)
    tokens, first, t0 = 0, loop.num_steps, time.perf_counter()
    while loop.has_work():
        tokens += sum(len(d.token_ids) for d in loop.step())
    seconds = time.perf_counter() - t0
    steps = loop.num_steps - first  # executed steps (an overlapped loop's last call only flushes)
    return {"output_tokens": tokens, "seconds": seconds, "output_tokens_per_s": tokens / seconds,
            "steps": steps, "step_ms": 1e3 * seconds / steps,
            "reserve_ms": 1e3 * memory.seconds["reserve"] / steps,
            "execute_ms": 1e3 * executor.seconds["execute"] / steps}


def through_gateway(address: str, prompts: list[list[int]], sampling: SamplingParams) -> dict:
    from pagedserve.client import GenerationClient

    counts = [0] * len(prompts)
    with GenerationClient(address, timeout=3600) as client:
        def one(i):
            counts[i] = sum(len(d.token_ids) for d in client.generate(prompts[i], sampling))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seconds = time.perf_counter() - t0
    return {"output_tokens": sum(counts), "seconds": seconds,
            "output_tokens_per_s": sum(counts) / seconds}


def split_runs(args, prompts_for, sampling, warm) -> tuple[dict, dict[str, dict], int]:
    from gateway.batch_loop import BatchLoop
    from gateway.remote import RemoteExecutorClient, RemoteMemoryClient
    from gateway.scheduler import SchedulerConfig
    from pagedserve.serve_cmd import free_port, service_specs
    from pagedserve.supervisor import Supervisor

    spec_args = serve_namespace(args, port=free_port())
    sup = Supervisor(service_specs(spec_args))
    try:
        sup.start()
        memsvc, executor = (sup.by_name[n].spec.address for n in ("memsvc", "executor"))
        gateway = sup.by_name["gateway"].spec.address
        remote_ex = RemoteExecutorClient(executor)
        vocab = remote_ex.model_info().vocab_size
        through_gateway(gateway, warm(vocab, 0), sampling)
        via_gateway = through_gateway(gateway, prompts_for(vocab, 0), sampling)
        memory, executor = TimedMemory(RemoteMemoryClient(memsvc)), TimedExecutor(remote_ex)
        split = {}
        for kind, run in (("ahead", 1), ("serial", 3), ("overlap", 4)):
            loop = BatchLoop(memory, executor, SchedulerConfig(
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                overlap=kind != "serial", plan_ahead=kind == "ahead"))
            drive(loop, warm(vocab, run), sampling)
            split[kind] = drive(loop, prompts_for(vocab, run), sampling)
            loop.close()
        memory.inner.close()
        remote_ex.close()
    finally:
        sup.stop()
    return via_gateway, split, vocab


def serve_namespace(args, port: int):
    """`pagedserve serve` arguments for the same engine settings, through the real parser."""
    import argparse

    from pagedserve.engine_config import EngineConfig
    from pagedserve.serve_cmd import add_serve_flags

    parser = argparse.ArgumentParser(prog="pagedserve serve")
    add_serve_flags(parser)
    return parser.parse_args(["--port", str(port), "--http-port", "0",
                              *EngineConfig.from_args(args).to_argv()])


def run(args) -> int:
    from gateway.batch_loop import BatchLoop
    from pagedserve.engine import LLMEngine
    from pagedserve.engine_config import EngineConfig

    sampling = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)

    def prompts_for(vocab, run: int, n: int | None = None):
        """Fresh prompts for each run (0 gateway, 1 split loop, 2 in process, 3 serial split loop, 4
        split loop with outputs overlapped only); warm-ups
        draw their own (run + 10): nothing measured is in the prefix cache beforehand."""
        rng = random.Random(args.seed * 1000 + run)
        return [random_prompt_ids(rng, args.input_len, vocab) for _ in range(n or args.num_requests)]

    def warm(vocab, run: int):
        return prompts_for(vocab, run + 10, 2)

    via_gateway, splits, vocab = split_runs(args, prompts_for, sampling, warm)
    split, serial = splits["ahead"], splits["serial"]
    engine = LLMEngine(EngineConfig.from_args(args))
    loop = BatchLoop(TimedMemory(engine.memory), TimedExecutor(engine.loop.executor), engine.loop.scheduler.config,
                     engine.tokenizer)
    drive(loop, warm(vocab, 2), sampling)
    local = drive(loop, prompts_for(vocab, 2), sampling)
    result = {"num_requests": args.num_requests, "input_len": args.input_len,
              "output_len": args.output_len, "max_num_seqs": args.max_num_seqs,
              "machine": f"{os.cpu_count()} CPUs", "in_process": local, "split_loop": split,
              "split_loop_serial": serial, "split_loop_overlap_outputs_only": splits["overlap"],
              "gateway": via_gateway,
              "gateway_vs_in_process": via_gateway["output_tokens_per_s"] / local["output_tokens_per_s"],
              "split_vs_in_process": split["output_tokens_per_s"] / local["output_tokens_per_s"],
              "rpc_overhead_ms_per_step": split["step_ms"] - local["step_ms"]}
    print(f"{args.num_requests} requests, {args.input_len} in / {args.output_len} out, "
          f"max {args.max_num_seqs} sequences per step")
    for name, r in (("in process", local), ("split loop", split), ("  serial", serial),
                    ("  outputs", splits["overlap"])):
        print(f"{name:12s} {r['output_tokens_per_s']:8.1f} tok/s  {r['steps']} steps, "
              f"{r['step_ms']:.1f} ms/step (reserve {r['reserve_ms']:.1f}, execute {r['execute_ms']:.1f})")
    print(f"{'gateway':12s} {via_gateway['output_tokens_per_s']:8.1f} tok/s  (clients streaming)")
    print(f"split loop / in process {result['split_vs_in_process']:.3f}, gateway / in process "
          f"{result['gateway_vs_in_process']:.3f}; RPC overhead "
          f"{result['rpc_overhead_ms_per_step']:.1f} ms per step")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    return 0
