"""`pagedserve bench control-plane`: what the services cost per step when the model costs nothing.

memsvc and a zero-cost executor (`pagedserve executor --zero-cost`: one fixed token per
sequence, nothing computed) run as real processes; the gateway's batching loop runs here
over its gRPC clients (with the step retry and the step telemetry around them, as in the
gateway). Each batch size B submits B requests at once (`--input-len` prompt tokens,
`--output-len` output tokens, ignore_eos, max_num_seqs = B), after one warm-up round, and
reports milliseconds per step split into gateway scheduling, Reserve (wire + memsvc, forks
included), Execute (wire + the executor's bookkeeping) and output handling (tokens applied,
detokenized, deltas). In an overlapped loop, Execute is what is left of it after the work
done while it runs (outputs, and with plan ahead the next step's plan and Reserve), so the
parts add up to the step.

`--simulate MODEL_SHAPE@GPU` or `--simulate-step-ms MS` runs a simulated accelerator instead
(pagedserve.executor.simulated: the zero-cost executor sleeping a modeled step time, no CPU). Each row
then also says how busy it kept that accelerator: `busy` is the executor's simulated
seconds over the measured run's wall seconds (0 with the zero-cost executor, which models
no time), `idle_ms` the wall time per step it was not busy, and `cpu_ms` the CPU
milliseconds per step of each process, gateway (this process), memsvc and executor, from
/proc (pagedserve.benchmarks.proc_cpu).
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import urllib.request

from pagedserve.benchmarks.proc_cpu import cpu_seconds
from pagedserve.wire.protocol import SamplingParams

SIMULATED_METRIC = "pagedserve:execute_simulated_seconds_total"


def add_batch_args(p, batch_sizes: str, output_len: int) -> None:
    """The batch sizes and request shape a per-step benchmark runs (bench step-cost too)."""
    p.add_argument("--batch-sizes", default=batch_sizes, help="comma-separated batch sizes")
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=output_len, help="output tokens per request")


def add_parser(sub) -> None:
    p = sub.add_parser("control-plane", help="per-step cost of the gateway loop, memsvc and the wire "
                       "with a zero-cost or simulated executor", description=__doc__.split("\n\n")[0])
    add_batch_args(p, "64,256,1024", 64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="memsvc without the prefix cache")
    p.add_argument("--loops", default="ahead",
                   help="comma-separated loop kinds, run in turn: ahead (the gateway's default: "
                   "outputs handled and the next step planned and reserved while a step runs), "
                   "overlap (outputs only), serial (one phase after the other)")
    p.add_argument("--simulate", metavar="MODEL_SHAPE@GPU",
                   help="the executor is a simulated accelerator with a roofline step time "
                   "(pagedserve executor --simulate: e.g. llama-8b@h200, llama-1b@h200; the shapes, "
                   "GPUs and figures are in its --help)")
    p.add_argument("--simulate-step-ms", type=float, metavar="MS",
                   help="the executor is a simulated accelerator whose every step takes MS")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object keyed by batch size (by loop kind, then batch size, "
                   "with several --loops), nothing else")
    p.add_argument("--out", default="bench_results/control_plane.json", help="JSON results file")
    p.set_defaults(run=run)


def start_services(block_size: int, kv_tokens: int, prefix_caching: bool = True,
                   simulate: str | None = None, simulate_step_ms: float | None = None):
    """memsvc and a zero-cost (or simulated) executor as processes under a Supervisor (started),
    closed by a fresh internal token (returned last, for the clients). The executor of a
    simulation serves metrics (`--metrics-port`), for its simulated seconds."""
    from pagedserve.executor.config import ExecutorConfig
    from pagedserve.memsvc.config import MemoryConfig, MemsvcConfig
    from pagedserve.rpc.internal_auth import new_token
    from pagedserve.rpc.ports import free_port
    from pagedserve.supervisor import ServiceSpec, Supervisor
    from pagedserve.wire.settings import secret_env, to_argv

    cli = [sys.executable, "-m", "pagedserve.cli"]
    token = new_token()
    m = MemsvcConfig(port=free_port(), internal_token=token, memory=MemoryConfig(
        kv_tokens=kv_tokens, prefix_caching=prefix_caching, preemption_mode="recompute"))
    simulated = simulate is not None or simulate_step_ms is not None
    e = ExecutorConfig(port=free_port(), memsvc=f"127.0.0.1:{m.port}", block_size=block_size,
                       internal_token=token, zero_cost=not simulated, simulate=simulate,
                       simulate_step_ms=simulate_step_ms, metrics_port=free_port() if simulated else None,
                       max_model_len=8192)
    sup = Supervisor([
        ServiceSpec("memsvc", cli + ["memsvc", *to_argv(m)], f"127.0.0.1:{m.port}",
                    shm_patterns=["/dev/shm/pagedserve-kv-{pid}-*"], env=secret_env(m)),
        ServiceSpec("executor", cli + ["executor", *to_argv(e)], f"127.0.0.1:{e.port}", env=secret_env(e)),
    ], log=lambda *a: None)
    sup.start()
    return sup, f"127.0.0.1:{m.port}", f"127.0.0.1:{e.port}", e.metrics_port, token


def simulated_seconds_of(metrics_port: int | None):
    """A callable: the executor's simulated seconds so far (0.0 without a simulation)."""
    def read() -> float:
        if metrics_port is None:
            return 0.0
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
        for line in text.splitlines():
            if line.startswith(SIMULATED_METRIC + " "):
                return float(line.split()[1])
        raise RuntimeError(f"the executor's metrics have no {SIMULATED_METRIC}")

    return read


def service_pids(sup) -> dict[str, int | None]:
    """{process: pid}: None for the gateway, which is this process (pagedserve.benchmarks.proc_cpu)."""
    return {"gateway": None, "memsvc": sup.by_name["memsvc"].proc.pid,
            "executor": sup.by_name["executor"].proc.pid}


LOOP_KINDS = ("ahead", "overlap", "serial")


def build_loop(memsvc: str, executor: str, batch: int, input_len: int, kind: str = "ahead",
               token: str | None = None):
    """The gateway's loop over the services (called with the internal `token`), built as the
    gateway builds it (step retry, request telemetry and step spans around the clients), with
    the tokenizer."""
    from pagedserve.gateway.batch_loop import BatchLoop
    from pagedserve.gateway.metrics import GatewayMetrics
    from pagedserve.gateway.remote import RemoteExecutorClient, RemoteMemoryClient
    from pagedserve.gateway.request_telemetry import RequestTelemetry
    from pagedserve.gateway.scheduler_config import SchedulerConfig
    from pagedserve.gateway.step_retry import StepRetry
    from pagedserve.gateway.step_telemetry import ObservedExecutor, ObservedMemory
    from pagedserve.gateway.tokenizer import load_tokenizer
    from pagedserve.rpc.heap import freeze_heap

    mem = RemoteMemoryClient(memsvc, token=token)
    ex = RemoteExecutorClient(executor, token=token, tables=mem.tables)
    info = ex.model_info()
    retry = StepRetry(mem, ex)
    telemetry = RequestTelemetry(GatewayMetrics())
    memory = ObservedMemory(retry.memory, telemetry, info.kv.block_size)
    config = SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=max(2048, batch * input_len),
                             overlap=kind != "serial", plan_ahead=kind == "ahead")
    loop = BatchLoop(memory, ObservedExecutor(retry.executor, telemetry, memory), config,
                     load_tokenizer(info.tokenizer_dir))
    memory.request_of = loop.request_of
    freeze_heap()  # as the gateway does once connected
    return loop, (mem, ex)


def measure(loop, batch: int, input_len: int, output_len: int, tag: str) -> dict:
    sampling = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    vocab = loop.info.vocab_size
    for i in range(batch):  # fresh prompts: nothing from the prefix cache
        prompt = [(hash((tag, i, j)) % (vocab - 1000)) + 500 for j in range(input_len)]
        loop.add_request(f"{tag}-{i}", prompt, sampling)
    loop.times.clear()
    t0 = time.perf_counter()
    tokens = 0
    while loop.has_work():
        tokens += sum(len(d.token_ids) for d in loop.step())
    seconds = time.perf_counter() - t0
    t = loop.times
    steps = max(t.steps, 1)
    if tokens != batch * output_len:
        raise RuntimeError(f"{tokens} tokens came out, {batch * output_len} expected")
    return {"ms_per_step": 1e3 * seconds / steps, "schedule_ms": 1e3 * t.schedule / steps,
            "reserve_ms": 1e3 * t.reserve / steps, "execute_ms": 1e3 * t.execute / steps,
            "output_ms": 1e3 * t.output / steps, "steps": t.steps, "output_tokens": tokens,
            "reserved_ahead": loop.num_ahead - loop.num_deferred}


def measure_busy(loop, batch: int, input_len: int, output_len: int, tag: str, pids: dict,
                 simulated) -> dict:
    """`measure`, plus busy, idle_ms and cpu_ms (per process) over the same run."""
    sim0 = simulated()
    cpu0 = {name: cpu_seconds(pid) for name, pid in pids.items()}
    r = measure(loop, batch, input_len, output_len, tag)
    cpu = {name: cpu_seconds(pid) - cpu0[name] for name, pid in pids.items()}
    busy_s = simulated() - sim0
    steps = max(r["steps"], 1)
    wall = r["ms_per_step"] * steps / 1e3
    r["busy"] = busy_s / wall
    r["idle_ms"] = 1e3 * (wall - busy_s) / steps
    r["cpu_ms"] = {name: 1e3 * seconds / steps for name, seconds in cpu.items()}
    return r


def run(args) -> int:
    from pagedserve.executor.config import ExecutorConfig

    try:  # the executor's own checks, before any process starts
        ExecutorConfig(simulate=args.simulate, simulate_step_ms=args.simulate_step_ms)
    except ValueError as e:
        print(f"bench control-plane: {e}", file=sys.stderr)
        return 2
    sizes = [int(x) for x in args.batch_sizes.split(",") if x.strip()]
    kinds = [k.strip() for k in args.loops.split(",") if k.strip()]
    bad = [k for k in kinds if k not in LOOP_KINDS]
    if bad or not kinds:
        print(f"--loops: {', '.join(bad) or 'nothing'} is not one of {', '.join(LOOP_KINDS)}", file=sys.stderr)
        return 2
    biggest = max(sizes)
    per_seq = args.input_len + args.output_len
    kv_tokens = (biggest * (-(-per_seq // args.block_size)) + 64) * args.block_size
    sup, memsvc, executor, metrics_port, token = start_services(
        args.block_size, kv_tokens, not args.no_prefix_caching, args.simulate, args.simulate_step_ms)
    pids, simulated = service_pids(sup), simulated_seconds_of(metrics_port)
    results: dict[str, dict[str, dict]] = {k: {} for k in kinds}
    try:
        for batch in sizes:
            for kind in kinds:  # in turn at each size: the same conditions for each kind
                loop, clients = build_loop(memsvc, executor, batch, args.input_len, kind, token)
                measure(loop, min(batch, 64), args.input_len, 8, f"warm{batch}{kind}")
                results[kind][str(batch)] = measure_busy(loop, batch, args.input_len, args.output_len,
                                                         f"b{batch}{kind}", pids, simulated)
                loop.close()
                for c in clients:
                    c.close()
    finally:
        sup.stop()
    flat = results[kinds[0]] if len(kinds) == 1 else results
    if args.json:
        print(json.dumps(flat))
    else:
        print(f"control plane: {executor_name(args)} executor, {args.input_len} in / "
              f"{args.output_len} out, all requests at once ({os.cpu_count()} CPUs, load "
              f"{os.getloadavg()[0]:.2f}); busy: simulated / wall seconds, idle and CPU: ms per step")
        print(f"{'loop':>8} {'batch':>6} {'ms/step':>8} {'schedule':>9} {'reserve':>8} {'execute':>8} "
              f"{'output':>7} {'ahead':>6} {'busy':>5} {'idle':>6} {'cpu gw':>7} {'memsvc':>7} "
              f"{'exec':>6}")
        for batch in sizes:
            for kind in kinds:
                r = results[kind][str(batch)]
                print(f"{kind:>8} {batch:>6} {r['ms_per_step']:8.2f} {r['schedule_ms']:9.2f} "
                      f"{r['reserve_ms']:8.2f} {r['execute_ms']:8.2f} {r['output_ms']:7.2f} "
                      f"{r['reserved_ahead']:>6} {r['busy']:5.2f} {r['idle_ms']:6.2f} "
                      f"{r['cpu_ms']['gateway']:7.2f} {r['cpu_ms']['memsvc']:7.2f} "
                      f"{r['cpu_ms']['executor']:6.2f}")
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"input_len": args.input_len, "output_len": args.output_len,
                       "executor": executor_name(args),
                       "load": os.getloadavg()[0], "results": flat}, f, indent=1)
    return 0


def executor_name(args) -> str:
    if args.simulate is not None:
        return f"simulated {args.simulate}"
    if args.simulate_step_ms is not None:
        return f"simulated {args.simulate_step_ms:g} ms/step"
    return "zero-cost"
