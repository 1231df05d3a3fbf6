"""The executor over gRPC: the pagedserve.v1.Executor service around one pagedserve.executor.Executor.

Service contract:
- The server listens at once with health NOT_SERVING; it loads the model, registers with
  memsvc (retrying until --register-timeout), maps the pool memsvc returns (shared memory
  by name on the CPU, CUDA IPC on a GPU) and only then says SERVING. A failure on the way
  ends the process with status 1.
- ModelInfo: name, maximum length (capped by --max-model-len), vocabulary size, EOS ids,
  chat template, KV geometry, and the tokenizer files themselves, so a gateway on another
  host needs no copy of the model. UNAVAILABLE until SERVING.
- Execute runs one step and returns one output per sequence with sample=True (or with
  prompt logprobs or an error to report), in batch order (pagedserve.wire.step_outputs;
  tokens alone, packed, where none carries more: pagedserve.wire.step_convert). A step carries only what changed per
  sequence: the executor keeps each running sequence's block table, sampling parameters,
  (for penalties) token history and (for prompt logprobs) prompt
  (pagedserve.executor.sequence_state), scoped by the gateway's session; a request that relies on
  state this process does not hold (it restarted) is FAILED_PRECONDITION, and the gateway
  sends everything again. A session's steps run in their numbered order, the next one
  expanded while the current one runs; a fed token (pagedserve.wire.step_feed) is put in place from
  this executor's own last sample just before the pass, and one it does not hold is
  FAILED_PRECONDITION (the gateway sends the token). Calls that arrive while a pass runs
  (several gateways) are merged into the next pass, launched one at a time from one thread
  (pagedserve.executor.step_merger: on a device that runs behind the host, while the last one runs).
  A batch that does not fit (bad slots, ids outside the vocabulary) is INVALID_ARGUMENT;
  the executor stays usable.
- The pool belongs to memsvc: this process only maps it, and must run on memsvc's host.
  An Execute whose `pool_epoch` names another pool is ABORTED (docs/ARCHITECTURE.md,
  "The pool epoch").
- An Execute that arrives with trace context gets a span (pagedserve.rpc.tracing);
  `--metrics-port` serves pagedserve.executor.metrics; `--tls-*` (pagedserve.rpc.tls) turn on TLS for
  this server (mutual with `--tls-ca`) and for the registration call to memsvc; with
  mutual TLS, Execute and ModelInfo are for callers whose certificate says gateway
  (pagedserve.rpc.peer_auth; others PERMISSION_DENIED). `--health-port` serves the health alone in
  plaintext (pagedserve.rpc.health_port: Kubernetes probes).
- With `--internal-token` every call but health's must carry it (pagedserve.rpc.internal_auth; else
  UNAUTHENTICATED), the step channel's connections too, and the registration at memsvc
  carries it. Without a token and without mutual TLS the executor does not start (status
  2) unless `--insecure-internal` says it may be open.
- Drain (`--drain-timeout S`): on SIGTERM the health turns NOT_SERVING at once, so
  gateways route no new request here (pagedserve.gateway.replica_set), while Execute goes on serving
  the running ones; the process stops once no Execute has come for DRAIN_IDLE_S (their
  requests finished) or after S seconds (gateways then recompute what is left elsewhere).
"""
from __future__ import annotations

import os
import sys
import threading
import time

import grpc

from opentelemetry import trace

from pagedserve.executor.config import ExecutorConfig
from pagedserve.executor.hub import TOKENIZER_FILES
from pagedserve.executor.metrics import ExecutorMetrics
from pagedserve.executor.pool_register import map_pool, register
from pagedserve.executor.sequence_state import SequenceStates, StateLost
from pagedserve.executor.step_merger import StepMerger, launch_of
from pagedserve.wire.step_feed import FedTokenUnknown
from pagedserve.wire import convert, step_convert
from pagedserve.rpc import internal_auth, peer_auth
from pagedserve.rpc.grpc_service import Service, get_logger, stop_on_signals, wait
from pagedserve.rpc.heap import freeze_heap
from pagedserve.rpc.step_channel_server import offer_step_channel
from pagedserve.wire.protocol import ModelInfo
from pagedserve.wire.v1 import executor_pb2, executor_pb2_grpc

SERVICE_NAME = "pagedserve.v1.Executor"
DRAIN_IDLE_S = 2.0  # longer than a gateway's probe interval (1 s): all have seen NOT_SERVING
HOLD_READBACK_S = 0.5  # --hold-readback: a step's outputs wait this long at most for the next
# step (a gateway sends it ahead within milliseconds, or not at all and waits for these outputs);
# held only as long as the pass took, a gateway slower than a short pass fed nothing on the device
log = get_logger("executor")


def read_tokenizer_files(tokenizer_dir: str) -> dict[str, bytes]:
    """The files a tokenizer (and its chat template) loads from, those that exist."""
    files = {}
    for name in TOKENIZER_FILES:
        path = os.path.join(tokenizer_dir, name)
        if tokenizer_dir and os.path.isfile(path):
            with open(path, "rb") as f:
                files[name] = f.read()
    return files


class ExecutorService(executor_pb2_grpc.ExecutorServicer):
    """Answers UNAVAILABLE until `set_ready` hands it an executor with its pool attached
    (anything with execute(batch)) and the model info to report."""

    def __init__(self):
        self.executor = None
        self.info_message = None
        self.pool_epoch: str | None = None  # memsvc's name for the pool this process mapped
        self.ready = threading.Event()
        self.metrics = ExecutorMetrics()
        self.last_call = float("-inf")  # time.monotonic() of the latest Execute's start or end
        self.active = 0  # Execute calls in progress
        self.step_port = 0  # the step channel's (pagedserve.rpc.step_channel), when one is offered
        self._calls = threading.Lock()

    def _enter(self, delta: int) -> None:
        with self._calls:
            self.active += delta
            self.last_call = time.monotonic()

    def set_ready(self, executor, info: ModelInfo, tokenizer_files: dict[str, bytes],
                  pool_epoch: str | None = None, hold_s: float = 0.0) -> None:
        self.executor = executor
        self.merger = StepMerger(_launch_of(executor), self.metrics.merged_calls.inc, hold_s=hold_s)
        self.info_message = convert.model_info_to_proto(info, tokenizer_files)
        self.pool_epoch = pool_epoch
        self.states = SequenceStates(info.kv.block_size)
        self.ready.set()

    def ModelInfo(self, request, context):
        if not self.ready.is_set():
            context.abort(grpc.StatusCode.UNAVAILABLE, "the executor is starting: the pool is not mapped yet")
        return self.info_message

    def Execute(self, request, context):
        if not self.ready.is_set():
            context.abort(grpc.StatusCode.UNAVAILABLE, "the executor is starting: the pool is not mapped yet")
        if request.pool_epoch and self.pool_epoch and request.pool_epoch != self.pool_epoch:
            context.abort(grpc.StatusCode.ABORTED, "this step was reserved in a KV pool that is "
                          "gone (memsvc restarted): reserve it again")
        order = self.states.order(request.session_id)
        order.wait_turn(request.step, request.first_step)
        try:
            step = self.states.expand(request)
        except BaseException as e:
            order.passed(request.step)
            if isinstance(e, StateLost):
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
            if isinstance(e, (ValueError, IndexError)):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"batch rejected: {e}")
            raise
        batch = step.batch
        tokens = len(batch.token_ids)
        guided = getattr(self.executor, "guided", None)
        if guided is not None:  # new grammars compile from now on, while the step before runs
            guided.expect(batch)

        def before():  # on the model thread, just before the pass: the session's next step may expand
            try:
                self.states.fill(step)
                if batch.device_feed is not None:
                    self.metrics.fed_on_device.inc()
            finally:
                order.passed(request.step)

        self._enter(1)
        try:
            outputs, seconds = self.merger.run(batch, request.session_id or context.peer(), before,
                                               lambda outs: self.states.record(step, outs))
        except FedTokenUnknown as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except (ValueError, IndexError) as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"batch rejected: {e}")
        finally:
            self._enter(-1)
        self.metrics.observe(batch.num_seqs, tokens, seconds)
        span = trace.get_current_span()
        if span.is_recording():
            span.set_attributes({"pagedserve.batch.sequences": batch.num_seqs,
                                 "pagedserve.batch.tokens": tokens, "pagedserve.forward_seconds": seconds})
        response = step_convert.outputs_to_proto(outputs, self.states.incarnation)
        response.step_port = self.step_port
        return response


def drain(service: Service, servicer: ExecutorService, timeout: float, idle: float = DRAIN_IDLE_S,
          clock=time.monotonic, sleep=time.sleep) -> bool:
    """NOT_SERVING, then wait until no Execute has run for `idle` seconds (counted from now at
    the earliest) or `timeout` passed. True when the gateways went quiet in time."""
    service.set_serving(False)
    start = clock()
    while clock() - start < timeout:
        if servicer.active == 0 and clock() - max(servicer.last_call, start) >= idle:
            return True
        sleep(0.05)
    return False


def _launch_of(executor):
    """The executor's launch (pagedserve.executor.step_merger) with its device current, for the merger's
    model thread.

    One long-lived model thread: torch's OpenMP runtime keeps one thread team per calling
    thread, so passes hopping between gRPC workers left the last team's threads spinning
    against the new one's (on a 2-core machine a batch-64 decode step took ~1.5x as long as
    in process); and gRPC worker threads start on device 0."""
    from pagedserve.pool_share.device import device_index, on_device

    device = getattr(executor, "device", "cpu")
    launch = getattr(executor, "launch", None) or launch_of(executor.execute)
    if device_index(device) is None:  # the CPU: nothing to make current
        return launch

    def on_its_device(batch):
        with on_device(device):
            return launch(batch)

    return on_its_device


def resolve_device(device: str) -> tuple[str, str]:
    """(torch device for the model, device name for memsvc: 'cpu' or a GPU UUID).

    `device` is a --device value (pagedserve.pool_share.device: auto, cpu, cuda, cuda:N, GPU-<uuid>); a GPU
    goes to memsvc by its physical UUID, since memsvc may see other device indices."""
    from pagedserve.pool_share.device import resolve_device as torch_device_for

    torch_device = torch_device_for(device)
    if torch_device == "cpu":
        return "cpu", "cpu"
    from pagedserve.pool_share.cuda_ipc import gpu_uuids, is_gpu_uuid

    if is_gpu_uuid(device):
        return torch_device, device
    return torch_device, gpu_uuids()[int(torch_device.split(":", 1)[1])]


def bring_up(config: ExecutorConfig, service: Service, servicer: ExecutorService) -> None:
    """Load, register, map; then SERVING. Runs beside the main thread, which waits for signals."""
    from pagedserve.executor import Executor

    from pagedserve.pool_share.device import on_device, resolve_dtype

    if config.model_free:
        from pagedserve.executor.metrics import SimulatedSeconds
        from pagedserve.executor.model_source import default_model_dir
        from pagedserve.executor.simulated import SimulatedExecutor
        from pagedserve.executor.zero_cost import ZeroCostExecutor

        torch_device, memsvc_device = "cpu", "cpu"
        args = (config.block_size, config.max_model_len or 8192, default_model_dir(progress=False))
        if config.simulated:
            fixed = config.simulate_step_ms is not None
            executor = SimulatedExecutor(*args, spec=None if fixed else config.simulate,
                                         step_ms=config.simulate_step_ms)
            SimulatedSeconds(executor, servicer.metrics.registry)
            log.info("simulated executor %s: one fixed token per sequence after a modeled step "
                     "time, no model", executor.info.name)
        else:
            executor = ZeroCostExecutor(*args)
            log.info("zero-cost executor: one fixed token per sequence, no model")
    else:
        torch_device, memsvc_device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, torch_device)
        log.info("device %s (%s), dtype %s", torch_device, memsvc_device, dtype)
        with on_device(torch_device):
            executor = Executor(config.model, dtype=dtype, block_size=config.block_size,
                                revision=config.revision, served_model_name=config.served_model_name,
                                device=torch_device, linear_backend=config.linear_backend,
                                model_impl=config.model_impl, kv_cache_dtype=config.kv_cache_dtype,
                                tensor_parallel_size=config.tensor_parallel_size,
                                group_timeout=config.tensor_parallel_timeout,
                                on_group_lost=_exit_group_lost, group=_group(config))
        executor.guided.grammars.cache_bytes = config.grammar_cache_bytes
    info = executor.model_info()
    if config.max_model_len:
        info.max_model_len = min(info.max_model_len, config.max_model_len)
    log.info("model %s loaded; registering with memsvc at %s", info.name, config.memsvc)
    ranks = 1 if config.model_free else config.tensor_parallel_size
    holds = _group(config).holds_own_pool if ranks > 1 else None
    budget = 0 if config.model_free else executor.kv_budget(config.gpu_memory_utilization)
    handle, pool_id = register(config.memsvc, info, memsvc_device, config.register_timeout, config.tls,
                               ranks=ranks, holds_pool=holds, token=config.internal_token,
                               budget_bytes=budget)
    with on_device(torch_device):
        executor.attach_pool(map_pool(handle))
        if config.hold_readback:
            if config.model_free or executor.runner is None or executor.leader is not None:
                raise ValueError("--hold-readback needs a model run in this one process "
                                 "(not --zero-cost, --simulate or --tensor-parallel-size > 1)")
            executor.runner.held_readback = True
        if not config.model_free:
            from pagedserve.executor.metrics import GraphSteps

            captured = executor.capture_graphs()
            if captured:
                log.info("captured %d CUDA graph buckets", captured)
            GraphSteps(executor, servicer.metrics.registry)
    servicer.set_ready(executor, info, read_tokenizer_files(info.tokenizer_dir), pool_id,
                       hold_s=HOLD_READBACK_S if config.hold_readback else 0.0)
    freeze_heap()
    service.set_serving(True)
    log.info("pool mapped (%d blocks of %d tokens); serving", handle.num_blocks, info.kv.block_size)


def _group(config: ExecutorConfig):
    """Where the tensor-parallel group meets and which of its ranks run here (pagedserve.executor.tp_group)."""
    from pagedserve.executor.tp_group import layout_of

    return layout_of(config.tensor_parallel_size, config.tensor_parallel_group)


def _exit_group_lost(why: str) -> None:
    """A tensor-parallel rank is gone: end this process (status 1), so the supervisor restarts
    the whole group; the pool stays in memsvc."""
    log.error("%s: exiting", why)
    os._exit(1)


def serve(config: ExecutorConfig) -> int:
    """Run the executor until SIGTERM/SIGINT (or until bring-up fails: status 1)."""
    from pagedserve.rpc.health_port import serve_health
    from pagedserve.rpc.metrics import serve_metrics
    from pagedserve.rpc.tracing import setup_tracing, shutdown_tracing

    from pagedserve.executor.tp_group import layout_of, run_worker_node

    try:
        layout = layout_of(config.tensor_parallel_size, config.tensor_parallel_group)
    except ValueError as e:
        print(f"executor: {e}", file=sys.stderr)
        return 2
    if layout.node > 0:  # a node of a tensor-parallel group that rank 0 leads from elsewhere
        return run_worker_node(config, layout)
    try:
        credentials = config.tls.server_credentials()
        internal_auth.require_closed("executor", config.internal_token, config.tls,
                                     config.insecure_internal, log)
    except (ValueError, OSError) as e:
        print(f"executor: {e}", file=sys.stderr)
        return 2
    stop = stop_on_signals()
    setup_tracing("executor", config.tracing)
    service = Service([SERVICE_NAME], max_workers=4,
                      interceptors=[*internal_auth.interceptors(config.internal_token),
                                    *peer_auth.interceptors(config.tls, peer_auth.EXECUTOR_POLICY)])
    servicer = ExecutorService()
    executor_pb2_grpc.add_ExecutorServicer_to_server(servicer, service.server)
    failed: list[str] = []

    def run_bring_up():
        try:
            bring_up(config, service, servicer)
        except Exception as e:  # any failure ends the process with a message
            failed.append(f"{type(e).__name__}: {e}")
            stop.set()

    address = service.start(config.host, config.port, credentials)
    channel = offer_step_channel(config, credentials, {"Execute": (servicer.Execute, executor_pb2.ExecuteRequest)},
                                 token=config.internal_token)
    servicer.step_port = channel.port if channel is not None else 0
    serve_metrics(servicer.metrics.registry, config.host, config.metrics_port, log)
    health_server = serve_health(service.health, config.host, config.health_port, log)
    log.info("listening on %s (NOT_SERVING until the pool is mapped)", address)
    threading.Thread(target=run_bring_up, name="executor-bring-up", daemon=True).start()
    try:
        wait(stop)
        if config.drain_timeout and servicer.ready.is_set() and not failed:
            log.info("draining: NOT_SERVING; running requests go on for up to %gs", config.drain_timeout)
            quiet = drain(service, servicer, config.drain_timeout)
            log.info("drained" if quiet else "drain timeout: stopping with steps still coming")
    finally:
        if health_server is not None:
            health_server.stop(0)
        if channel is not None:
            channel.close()
        service.stop()
        shutdown_tracing()
    if failed:
        log.error("could not start: %s", failed[0])
        return 1
    return 0
