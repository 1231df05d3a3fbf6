"""`pagedserve bench step-cost`: what each part of a step costs in CPU, per batch size, in
one process.

The gateway's loop (plan ahead, as served), memsvc's MemoryManager and the executor's
per-sequence state run in this process over a zero-cost executor, and every message makes
its wire round trip (to protobuf, serialized, parsed, back). They are clients as the remote
ones are (pagedserve.wire.clients: a call is made when sent, its Future answered), so what is measured is the Python of the step path without gRPC's calls or the hops
between threads and processes: `bench control-plane` measures those. Each part's thread CPU time per step (ms) is printed
beside the process's CPU and wall time per step. See docs/ARCHITECTURE.md, "The step path".
"""
from __future__ import annotations

import json
import operator
import os
import sys
import time
from collections import Counter

from pagedserve.wire.clients import ExecutorClient, MemoryClient
from pagedserve.rpc.sent import call_now

_token_ids = operator.attrgetter("token_ids")


def add_parser(sub) -> None:
    from pagedserve.benchmarks.control_plane import add_batch_args

    p = sub.add_parser("step-cost", help="CPU per step of each part of the step path, in one "
                       "process (no gRPC)", description=__doc__.split("\n\n")[0])
    add_batch_args(p, "64,256", 128)
    p.add_argument("--json", action="store_true", help="print one JSON object keyed by batch size")
    p.add_argument("--out", default="bench_results/step_cost.json", help="JSON results file")
    p.set_defaults(run=run)


class _Parts:
    """Thread CPU seconds per named part (`timed=False`: nothing is timed)."""

    def __init__(self, timed: bool = True):
        self.seconds: Counter = Counter()
        self.on = timed

    def timed(self, name: str, fn):
        if not self.on:
            return fn

        def call(*args, **kwargs):
            t0 = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.thread_time() - t0
        return call


class WireMemory(MemoryClient):
    """MemoryManager behind the Reserve message's round trip, a client as the remote one is:
    the call runs when sent."""

    def __init__(self, manager, parts: _Parts | None = None):
        parts = parts or _Parts(timed=False)
        from pagedserve.wire import step_convert
        from pagedserve.wire.v1 import memory_pb2

        t = parts.timed
        self.manager = manager
        self._plan_to = t("plan to proto", step_convert.plan_to_proto)
        self._plan_from = t("plan from proto", step_convert.plan_from_proto)
        self._reserve = t("memsvc reserve", manager.reserve)
        self._result_to = t("result to proto", step_convert.reserve_result_to_proto)
        self._result_from = t("result from proto", step_convert.reserve_result_from_proto)
        self._request, self._response = memory_pb2.ReserveRequest, memory_pb2.ReserveResponse

    def reserve(self, plan):
        return call_now(self.reserve_now, plan)

    def reserve_now(self, plan):
        """As memsvc's server takes it and the remote client reads the answer."""
        request = self._request.FromString(self._plan_to(plan, "s").SerializeToString())
        response = self._result_to(self._reserve(self._plan_from(request), "s"))
        return self._result_from(self._response.FromString(response.SerializeToString()))

    def free(self, seq_ids):
        self.manager.free(seq_ids, "s")

    def tables(self, seq_ids):
        return self.manager.tables(seq_ids, "s")

    def fork(self, parent_id, child_id):
        self.manager.fork(parent_id, child_id, "s")

    def stats(self):
        return self.manager.stats()


class WireExecutor(ExecutorClient):
    """An executor behind the Execute message's round trip, run as the executor service
    runs it (per-sequence state, steps in order, fed tokens), a client as the remote one
    is: the step runs when sent."""

    def __init__(self, executor, parts: _Parts | None = None):
        parts = parts or _Parts(timed=False)
        from pagedserve.executor.sequence_state import SequenceStates
        from pagedserve.wire import step_convert
        from pagedserve.wire.step_delta import encode_delta
        from pagedserve.wire.step_feed import StepOrder
        from pagedserve.wire.v1 import executor_pb2

        t = parts.timed
        self.executor, self.sent, self.order = executor, set(), StepOrder()
        self.states = SequenceStates(executor.model_info().kv.block_size)
        self._encode = t("step encode", encode_delta)
        self._expand = t("executor expand", self.states.expand)
        self._run = t("zero-cost execute", executor.execute)
        self._outputs_to = t("outputs to proto", step_convert.outputs_to_proto)
        self._outputs_from = t("outputs from proto", step_convert.outputs_from_proto)
        self._request, self._response = executor_pb2.ExecuteRequest, executor_pb2.ExecuteResponse

    def model_info(self):
        return self.executor.model_info()

    def step(self, step):
        return call_now(self.execute, step)

    def execute(self, step):
        self.order.wait_turn(step.step)
        try:
            request = self._encode(step, self.sent, "s", self.states.incarnation)
            expanded = self._expand(self._request.FromString(request.SerializeToString()))
            self.states.fill(expanded)
            outputs = self._run(expanded.batch)
            self.states.record(expanded, outputs)
            response = self._outputs_to(outputs, self.states.incarnation).SerializeToString()
            return self._outputs_from(self._response.FromString(response),
                                      step.sampled_ids())
        finally:
            self.order.passed(step.step)


def measure(batch: int, input_len: int, output_len: int) -> dict:
    """One batch of `batch` requests to the end; CPU per step per part (ms)."""
    from pagedserve.executor.model_source import default_model_dir
    from pagedserve.executor.zero_cost import ZeroCostExecutor
    from pagedserve.gateway.batch_loop import BatchLoop
    from pagedserve.gateway.scheduler_config import SchedulerConfig
    from pagedserve.gateway.tokenizer import load_tokenizer
    from pagedserve.memsvc.config import MemoryConfig
    from pagedserve.memsvc.memory_manager import MemoryManager
    from pagedserve.rpc.heap import freeze_heap
    from pagedserve.wire.protocol import SamplingParams

    parts = _Parts()
    executor = ZeroCostExecutor(16, 8192, default_model_dir(progress=False))
    kv_tokens = (batch * -(-(input_len + output_len) // 16) + 64) * 16
    manager = MemoryManager(MemoryConfig(num_blocks=kv_tokens // 16, max_model_len=8192))
    manager.register_executor(executor.model_info().kv, device="cpu")
    config = SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=max(2048, batch * input_len),
                             overlap=True, plan_ahead=True)
    loop = BatchLoop(WireMemory(manager, parts), WireExecutor(executor, parts), config,
                     load_tokenizer(executor.model_info().tokenizer_dir))
    sched = loop.scheduler
    for name in ("plan", "on_reserved", "on_sampled"):
        setattr(sched, name, parts.timed(name, getattr(sched, name)))
    loop._deltas = parts.timed("deltas", loop._deltas)
    sampling = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    vocab = executor.model_info().vocab_size
    for i in range(batch):
        loop.add_request(f"r{i}", [(i * 7919 + j * 104729) % (vocab - 1000) + 500 for j in range(input_len)],
                         sampling)
    freeze_heap()  # as the services do once started
    steps0, cpu0, wall0 = loop.num_steps, time.process_time(), time.perf_counter()
    tokens = 0
    try:
        while loop.has_work():
            tokens += sum(map(len, map(_token_ids, loop.step())))  # in C: the bench's own count costs next to nothing
    finally:
        loop.close()
    steps = max(loop.num_steps - steps0, 1)
    if tokens != batch * output_len:
        raise RuntimeError(f"{tokens} tokens came out, {batch * output_len} expected")
    if manager.allocator.sequence_ids():
        raise RuntimeError(f"memsvc still holds {len(manager.allocator.sequence_ids())} sequences")
    return {"steps": steps, "cpu_ms": 1e3 * (time.process_time() - cpu0) / steps,
            "wall_ms": 1e3 * (time.perf_counter() - wall0) / steps,
            "parts_ms": {k: 1e3 * v / steps for k, v in parts.seconds.most_common()}}


def run(args) -> int:
    from pagedserve.benchmarks.cpu_info import cpu_info, describe

    sizes = [int(x) for x in args.batch_sizes.split(",") if x.strip()]
    if not sizes or min(sizes) < 1:
        print("--batch-sizes: give positive batch sizes, e.g. 64,256", file=sys.stderr)
        return 2
    results = {str(b): measure(b, args.input_len, args.output_len) for b in sizes}
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"cpu": cpu_info(), "results": results}, f, indent=1)
    if args.json:
        print(json.dumps(results))
        return 0
    print(f"step cost in one process, zero-cost executor, {args.input_len} in / {args.output_len} out, "
          f"plan ahead ({describe(cpu_info())}); thread CPU ms per step")
    for b, r in results.items():
        print(f"batch {b}: {r['cpu_ms']:.2f} ms CPU, {r['wall_ms']:.2f} ms wall per step ({r['steps']} steps)")
        for name, ms in r["parts_ms"].items():
            print(f"  {ms:7.3f}  {name}")
    return 0
