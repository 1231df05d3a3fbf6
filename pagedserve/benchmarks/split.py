"""`pagedserve bench split`: split services against the in-process engine on the same workload.

The same requests (greedy, ignore_eos, all submitted at once), run in `--rounds` rounds in
alternating order (ABBA, the median run reported):
  - in process: the offline engine, the batching loop over direct calls;
  - through the gateway (served): memsvc, executor and gateway as processes (`pagedserve
    serve`); clients stream through the public API;
  - split loop: the same loop in this process over the gRPC clients of memsvc and the
    executor, as the gateway runs it (while a step runs: the last step's outputs handled,
    the next step planned and reserved); then with the outputs overlapped only; then
    serially.
Every call is timed, so a step's reserve and execute times include their RPCs; the
executor's own Execute time (its `pagedserve:execute_seconds` metric) gives, per step, what
the split costs beyond the forward pass, a figure the run-to-run noise of the forward pass
itself (±10% on small machines) does not drown. Each run
(and each warm-up) gets its own fresh random prompts, so no run finds another's prompt
blocks in the prefix cache (the gateway and the split loops share memsvc).
"""
from __future__ import annotations

import json
import os
import random
import statistics
import threading
import time
from collections import defaultdict
from concurrent.futures import Future

from pagedserve.benchmarks.workloads import random_prompt_ids
from pagedserve.wire.clients import ExecutorClient, MemoryClient
from pagedserve.rpc.sent import Sent
from pagedserve.wire.protocol import ModelInfo, PoolStats, SampleOutput, SamplingParams
from pagedserve.wire.reserve_messages import Plan, ReserveResult
from pagedserve.wire.step_delta import StepDelta


def add_parser(sub) -> None:
    from pagedserve.engine_config import add_engine_flags

    p = sub.add_parser("split", help="split services vs the in-process engine: throughput and RPC time",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--input-len", type=int, default=64, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=64, help="output tokens per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds of every run, in alternating order (the median is reported)")
    p.add_argument("--out", default="bench_results/split.json", help="JSON results file")
    add_engine_flags(p)
    p.set_defaults(run=run)


class _Timed:
    """Wraps a client (pagedserve.wire.clients); every call's wall time is added up by method name."""

    def __init__(self, inner):
        self.inner = inner
        self.seconds: dict[str, float] = defaultdict(float)

    def _timed(self, name: str, fn, *args):
        t = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.seconds[name] += time.perf_counter() - t

    def _timed_step(self, name: str, fn, *args) -> Future:
        """A step call: its sending and the wait for its answer are timed."""
        answer = self._timed(name, fn, *args)
        return Sent(lambda: self._timed(name, answer.result))


class TimedMemory(_Timed, MemoryClient):
    def reserve(self, plan: Plan) -> Future[ReserveResult]:
        return self._timed_step("reserve", self.inner.reserve, plan)

    def free(self, seq_ids: list[str]) -> None:
        self._timed("free", self.inner.free, seq_ids)

    def fork(self, parent_id: str, child_id: str) -> None:
        self._timed("fork", self.inner.fork, parent_id, child_id)

    def stats(self) -> PoolStats:
        return self._timed("stats", self.inner.stats)


class TimedExecutor(_Timed, ExecutorClient):
    def model_info(self) -> ModelInfo:
        return self._timed("model_info", self.inner.model_info)

    def step(self, step: StepDelta) -> Future[list[SampleOutput]]:
        return self._timed_step("execute", self.inner.step, step)


def drive(loop, prompts: list[list[int]], sampling: SamplingParams, executor_metrics=None) -> dict:
    """Run every prompt through a BatchLoop whose clients are timed; return the step numbers.
    `executor_metrics()`: the executor process's own (Execute seconds, calls) so far;
    without it, the timed Execute calls are the executor's time (in process)."""
    memory, executor = loop.memory, loop.executor
    memory.seconds.clear()
    executor.seconds.clear()
    for i, p in enumerate(prompts):
        loop.add_request(f"bench-{i}", p, sampling)
    server0 = executor_metrics()[0] if executor_metrics else 0.0
    tokens, first, t0 = 0, loop.num_steps, time.perf_counter()
    while loop.has_work():
        tokens += sum(len(d.token_ids) for d in loop.step())
    seconds = time.perf_counter() - t0
    steps = loop.num_steps - first  # executed steps (an overlapped loop's last call only flushes)
    server = executor_metrics()[0] - server0 if executor_metrics else executor.seconds["execute"]
    return {"output_tokens": tokens, "seconds": seconds, "output_tokens_per_s": tokens / seconds,
            "steps": steps, "step_ms": 1e3 * seconds / steps,
            "reserve_ms": 1e3 * memory.seconds["reserve"] / steps,
            "execute_ms": 1e3 * executor.seconds["execute"] / steps,
            "executor_ms": 1e3 * server / steps,
            "overhead_ms": 1e3 * (seconds - server) / steps}


def executor_metrics_of(metrics_url: str):
    """A callable: the executor's `pagedserve:execute_seconds` so far, from its metrics, as
    (sum of seconds, number of Execute calls)."""
    import re
    import urllib.request

    def read() -> tuple[float, int]:
        text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
        total = re.search(r"^pagedserve:execute_seconds_sum (\S+)", text, re.M).group(1)
        calls = re.search(r"^pagedserve:execute_seconds_count (\S+)", text, re.M).group(1)
        return float(total), int(float(calls))

    return read


def through_gateway(address: str, prompts: list[list[int]], sampling: SamplingParams,
                    executor_metrics=None) -> dict:
    """Every prompt streamed through the gateway at once. `executor_metrics()`: the
    executor's (Execute seconds, Execute calls) so far; with it, the steps and what they
    cost beyond the executor's own time are reported as for the loops (`drive`)."""
    from pagedserve.client import GenerationClient

    counts = [0] * len(prompts)
    with GenerationClient(address, timeout=3600) as client:
        def one(i):
            counts[i] = sum(len(d.token_ids) for d in client.generate(prompts[i], sampling))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        server0, calls0 = executor_metrics() if executor_metrics else (0.0, 0)
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seconds = time.perf_counter() - t0
    out = {"output_tokens": sum(counts), "seconds": seconds, "output_tokens_per_s": sum(counts) / seconds}
    if executor_metrics:
        server, calls = executor_metrics()
        steps = max(calls - calls0, 1)
        out.update(steps=steps, step_ms=1e3 * seconds / steps,
                   executor_ms=1e3 * (server - server0) / steps,
                   overhead_ms=1e3 * (seconds - (server - server0)) / steps)
    return out


# in process, through the gateway (served), and the split loop's three kinds
KINDS = ("in_process", "gateway", "ahead", "overlap", "serial")


def split_runs(args, prompts_for, sampling, warm) -> tuple[dict[str, list[dict]], int]:
    """`args.rounds` rounds of every kind in turn (in process, the gateway and the three
    split loops), against the same services: per kind, one result per round."""
    from pagedserve.gateway.batch_loop import BatchLoop
    from pagedserve.gateway.remote import RemoteExecutorClient, RemoteMemoryClient
    from pagedserve.gateway.scheduler_config import SchedulerConfig
    from pagedserve.engine import LLMEngine
    from pagedserve.engine_config import EngineConfig
    from pagedserve.rpc.ports import free_port
    from pagedserve.serve_cmd import service_specs
    from pagedserve.supervisor import Supervisor
    from pagedserve.rpc.heap import freeze_heap
    from pagedserve.rpc.internal_auth import ENV as TOKEN_ENV

    spec_args = serve_namespace(args, port=free_port())
    sup = Supervisor(with_executor_metrics(service_specs(spec_args), free_port()))
    runs: dict[str, list[dict]] = {k: [] for k in KINDS}
    try:
        sup.start()
        memsvc, executor = (sup.by_name[n].spec.address for n in ("memsvc", "executor"))
        gateway = sup.by_name["gateway"].spec.address
        argv = sup.by_name["executor"].spec.argv
        port = argv[argv.index("--metrics-port") + 1]
        server_metrics = executor_metrics_of(f"http://127.0.0.1:{port}/metrics")
        token = sup.by_name["memsvc"].spec.env.get(TOKEN_ENV)  # the one serve made for its services
        remote_mem = RemoteMemoryClient(memsvc, token=token)
        remote_ex = RemoteExecutorClient(executor, token=token, tables=remote_mem.tables)
        vocab = remote_ex.model_info().vocab_size
        memory, executor = TimedMemory(remote_mem), TimedExecutor(remote_ex)
        engine = LLMEngine(EngineConfig.from_args(args))
        freeze_heap()  # as the services do once started
        loops = {"in_process": BatchLoop(TimedMemory(engine.loop.memory), TimedExecutor(engine.loop.executor),
                                         engine.loop.scheduler.config, engine.tokenizer)}
        for kind in KINDS[2:]:
            loops[kind] = BatchLoop(memory, executor, SchedulerConfig(
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                overlap=kind != "serial", plan_ahead=kind == "ahead"))
        run = 1
        for r in range(args.rounds):
            for kind in (KINDS if r % 2 == 0 else KINDS[::-1]):  # ABBA: drift hits every kind alike
                if kind == "gateway":
                    through_gateway(gateway, warm(vocab, run), sampling)
                    runs[kind].append(through_gateway(gateway, prompts_for(vocab, run), sampling,
                                                      server_metrics))
                else:
                    metrics = None if kind == "in_process" else server_metrics
                    drive(loops[kind], warm(vocab, run), sampling)
                    runs[kind].append(drive(loops[kind], prompts_for(vocab, run), sampling, metrics))
                run += 1
        for loop in loops.values():
            loop.close()
        memory.inner.close()
        remote_ex.close()
    finally:
        sup.stop()
    return runs, vocab


def serve_namespace(args, port: int):
    """`pagedserve serve` arguments for the same engine settings, through the real parser."""
    import argparse

    from pagedserve.engine_config import EngineConfig
    from pagedserve.serve_cmd import add_serve_flags

    parser = argparse.ArgumentParser(prog="pagedserve serve")
    add_serve_flags(parser)
    # no HTTP API: it is not measured, and the GPU machine's image lacks its packages
    return parser.parse_args(["--port", str(port), "--http-port", "0", *EngineConfig.from_args(args).to_argv()])


def with_executor_metrics(specs: list, port: int) -> list:
    """The services with the executor's metrics on `port` (its Execute time is read there)."""
    executor = next(s for s in specs if s.name == "executor")
    argv = executor.argv
    if "--metrics-port" in argv:
        argv[argv.index("--metrics-port") + 1] = str(port)
    else:
        argv += ["--metrics-port", str(port)]
    return specs


def run(args) -> int:
    sampling = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)

    def prompts_for(vocab, run: int, n: int | None = None):
        """Fresh prompts for each run (0 the gateway, then one per measured run); warm-ups
        draw their own (run + 10000): nothing measured is in the prefix cache beforehand."""
        rng = random.Random(args.seed * 100000 + run)
        return [random_prompt_ids(rng, args.input_len, vocab) for _ in range(n or args.num_requests)]

    def warm(vocab, run: int):
        return prompts_for(vocab, run + 10000, 2)

    runs, vocab = split_runs(args, prompts_for, sampling, warm)
    median = {k: _median_run(v) for k, v in runs.items()}
    local = median["in_process"]
    overhead = {k: statistics.median(r["overhead_ms"] for r in v) for k, v in runs.items()}
    result = {"num_requests": args.num_requests, "input_len": args.input_len,
              "output_len": args.output_len, "max_num_seqs": args.max_num_seqs, "rounds": args.rounds,
              "machine": f"{os.cpu_count()} CPUs", "runs": runs,
              "gateway_vs_in_process": median["gateway"]["output_tokens_per_s"] / local["output_tokens_per_s"],
              "step_vs_in_process": {k: median[k]["step_ms"] / local["step_ms"] for k in KINDS},
              "overhead_ms": overhead,
              "step_vs_in_process_by_overhead": {
                  k: (local["executor_ms"] + overhead[k]) / (local["executor_ms"] + overhead["in_process"])
                  for k in KINDS}}
    print(f"{args.num_requests} requests, {args.input_len} in / {args.output_len} out, "
          f"max {args.max_num_seqs or 'the default'} sequences per step, {args.rounds} rounds (median run shown)")
    names = {"in_process": "in process", "gateway": "gateway", "ahead": "split loop",
             "overlap": "  outputs only", "serial": "  serial"}
    for kind in KINDS:
        r = median[kind]
        calls = (f"reserve {r['reserve_ms']:.1f}, execute {r['execute_ms']:.1f}" if "reserve_ms" in r
                 else "clients streaming")
        print(f"{names[kind]:15s} {r['output_tokens_per_s']:8.1f} tok/s  {r['steps']} steps, "
              f"{r['step_ms']:.1f} ms/step ({result['step_vs_in_process'][kind]:.3f}x; {calls}); "
              "every round: " + ", ".join(f"{x['step_ms']:.1f}" for x in runs[kind]))
    print("per step beyond the executor's own Execute time (its metrics; in process: the call), "
          "median ms: " + ", ".join(f"{names[k].strip()} {overhead[k]:.2f}" for k in KINDS))
    print("the in-process step with each of those: " + ", ".join(
        f"{names[k].strip()} {result['step_vs_in_process_by_overhead'][k]:.3f}x" for k in KINDS))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    return 0


def _median_run(runs: list[dict]) -> dict:
    return sorted(runs, key=lambda r: r["step_ms"])[len(runs) // 2]
