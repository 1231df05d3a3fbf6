"""memsvc over gRPC: the pagedserve.v1.MemoryManager service around one MemoryManager.

Service contract:
- RegisterExecutor(geometry, budget, device, max_model_len) allocates the pool on the
  first call and returns its PoolHandle: `shm_name` (CPU: /dev/shm/<name>, mode 0600) or
  `cuda_ipc_handle` + `gpu_uuid` (GPU). Later executors with the same geometry get the
  same pool (an executor restart keeps the KV state); a different geometry is
  FAILED_PRECONDITION. A tensor-parallel group lists its ranks' devices (`rank_devices`):
  memsvc holds one pool per rank (pagedserve.memsvc.kv_pool.rank_geometry) and answers each rank's
  segment in `rank_shm_names`, each rank mapping only its own (CPU ranks only so far).
- Reserve/Free/Fork/Tables need a `session_id` (one per gateway process): sequence ids are
  scoped to it, and each call renews its lease. A session silent for longer than the lease
  loses its sequences (an empty Reserve is a heartbeat). A running sequence memsvc no
  longer holds comes back in `preempted` with mode "recompute".
- Before any executor registered, Reserve/Fork/Stats answer UNAVAILABLE (retry: the pool
  does not exist yet).
- RegisterExecutor and Reserve answers carry this process's `pool_epoch`
  (docs/ARCHITECTURE.md, "The pool epoch").
- Health is SERVING from the moment it listens (its job starts with registration).
- WatchBlocks streams the prefix-cache keys (pagedserve.wire.block_keys) of the blocks the pool
  holds: a snapshot, then what each Reserve/Free stored and evicted, with the pool's load
  (pagedserve.memsvc.block_watch). Gateways follow it to route requests to the replica holding their
  prefix. Sessions share the pool fairly (pagedserve.memsvc.fair_share) and are only ever preempted
  by their own Reserve.
- One lock serializes every MemoryManager call (request handlers and the lease sweep).
- A Reserve that arrives with trace context gets a span (pagedserve.rpc.tracing) with what it
  decided; `--metrics-port` serves pagedserve.memsvc.metrics; `--tls-*` (pagedserve.rpc.tls) turn on TLS,
  mutual with `--tls-ca`, and then callers' roles are checked (pagedserve.rpc.peer_auth):
  RegisterExecutor only from an executor, the rest only from gateways (PERMISSION_DENIED).
  `--health-port` serves the health alone in plaintext (pagedserve.rpc.health_port: probes).
- With `--internal-token` every call but health's must carry it (pagedserve.rpc.internal_auth; else
  UNAUTHENTICATED), the step channel's connections too. Without a token and without mutual
  TLS memsvc does not start (status 2) unless `--insecure-internal` says it may be open.
"""
from __future__ import annotations

import dataclasses
import sys
import threading
import time

import grpc

from opentelemetry import trace

from pagedserve.memsvc.block_watch import BlockChanges, BlockWatch
from pagedserve.memsvc.config import MemsvcConfig
from pagedserve.memsvc.memory_manager import MemoryManager
from pagedserve.memsvc.metrics import MemsvcMetrics
from pagedserve.wire import convert, step_convert
from pagedserve.rpc import internal_auth, peer_auth
from pagedserve.rpc.grpc_service import Service, get_logger, stop_on_signals, wait
from pagedserve.rpc.heap import freeze_heap
from pagedserve.rpc.step_channel_server import offer_step_channel
from pagedserve.wire.v1 import memory_pb2, memory_pb2_grpc

SERVICE_NAME = "pagedserve.v1.MemoryManager"
DTYPES = ("float32", "bfloat16", "float16")
log = get_logger("memsvc")


class MemoryService(memory_pb2_grpc.MemoryManagerServicer):
    def __init__(self, manager: MemoryManager):
        self.manager = manager
        self.lock = threading.Lock()
        self.metrics = MemsvcMetrics(self)
        self.block_changes = BlockChanges()
        self.step_port = 0  # the step channel's (pagedserve.rpc.step_channel), when one is offered
        self._stopped = threading.Event()
        self._sweeper = threading.Thread(target=self._sweep, name="memsvc-lease-sweep", daemon=True)
        self._sweeper.start()

    def _sweep(self) -> None:
        interval = min(self.manager.config.session_lease / 4, 1.0)
        while not self._stopped.wait(interval):
            with self.lock:
                freed = self.manager.expire_sessions()
            for session_id, n in freed.items():
                log.info("session %s lapsed: freed %d sequences", session_id, n)
            if freed:
                self.block_changes.notify()

    def close(self) -> None:
        self._stopped.set()
        self.block_changes.notify()
        with self.lock:
            self.manager.close()

    def RegisterExecutor(self, request, context):
        g = request.geometry
        if g.dtype not in DTYPES:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"geometry.dtype must be one of {', '.join(DTYPES)}, got {g.dtype!r}")
        try:
            geometry = convert.geometry_from_proto(g)
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"geometry: {e}")
        device = request.device or "cpu"
        ranks = list(request.rank_devices)
        if ranks and len(set(ranks)) != 1:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"rank_devices {ranks}: every rank of a group on one device kind "
                          f"(all 'cpu') is all memsvc holds pools for so far")
        if ranks:
            device = ranks[0]
        try:
            with self.lock:
                pool = self.manager.register_executor(geometry, request.budget_bytes, device,
                                                      request.max_model_len, ranks=len(ranks) or 1,
                                                      holds_pool=list(request.rank_holds_pool))
        except ValueError as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except (LookupError, RuntimeError) as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"cannot allocate the pool on {device}: {e}")
        pools = pool if isinstance(pool, list) else [pool]
        held = [r for r, p in enumerate(pools) if p is None]
        log.info("executor registered: pool %s %s on %s%s%s (epoch %s)", list(pools[0].shape),
                 geometry.dtype, device, f" for each of {len(pools)} ranks" if len(pools) > 1 else "",
                 f", ranks {held} holding their own" if held else "", self.manager.pool_epoch[:8])
        return memory_pb2.RegisterExecutorResponse(pool=self._handle(pools),
                                                   pool_epoch=self.manager.pool_epoch)

    def _handle(self, pools: list) -> memory_pb2.PoolHandle:
        m = self.manager
        pool = pools[0]
        handle = memory_pb2.PoolHandle(num_blocks=pool.shape[0], shape=list(pool.shape),
                                       dtype=m.geometry.dtype)
        if m.shm is not None:
            handle.shm_name = m.shm.name
            if len(pools) > 1:  # "" for a rank that holds its own pool
                names = iter(shm.name for shm in m.shms)
                handle.rank_shm_names.extend("" if p is None else next(names) for p in pools)
        elif m.cuda_handle is not None:
            handle.cuda_ipc_handle = m.cuda_handle.pack()
            handle.gpu_uuid = m.cuda_handle.gpu_uuid
            handle.offset_bytes = m.cuda_handle.storage_offset_bytes
        return handle

    def Reserve(self, request, context):
        session = _session(request, context)
        plan = self._call(context, step_convert.plan_from_proto, request)
        result = self._reserve(context, self.manager.reserve, plan, session)

        def attributes():  # a pass over the step: only when the span is kept
            grants, modes = result.grants, [p.mode for p in result.preempted]
            return {"pagedserve.deferred": result.deferred,
                    "pagedserve.granted_sequences": len(grants),
                    "pagedserve.granted_tokens": sum(grants.num_tokens),
                    "pagedserve.cached_tokens": sum(grants.num_cached),
                    "pagedserve.preemptions.swap": modes.count("swap"),
                    "pagedserve.preemptions.recompute": modes.count("recompute")}
        response = step_convert.reserve_result_to_proto(result)
        span = trace.get_current_span()
        if span.is_recording():
            span.set_attributes({"pagedserve.session": session, **attributes(),
                                 "pagedserve.blocks_free": self.manager.allocator.num_free_blocks()})
        response.step_port = self.step_port
        return response

    def _reserve(self, context, fn, *args):
        """A Reserve under the lock, timed; block watchers are woken after it."""
        start = time.perf_counter()
        with self.lock:
            self._registered(context)
            answer = self._call(context, fn, *args)
        self.metrics.reserve_time.observe(time.perf_counter() - start)
        self.block_changes.notify()
        return answer

    def Free(self, request, context):
        session = _session(request, context)
        with self.lock:
            self._call(context, self.manager.free, list(request.seq_ids), session)
        self.block_changes.notify()
        return memory_pb2.FreeResponse()

    def Fork(self, request, context):
        session = _session(request, context)
        with self.lock:
            self._registered(context)
            self._call(context, self.manager.fork, request.parent_id, request.child_id, session)
        return memory_pb2.ForkResponse()

    def Tables(self, request, context):
        session = _session(request, context)
        with self.lock:
            self._registered(context)
            tables = self._call(context, self.manager.tables, list(request.seq_ids), session)
        return memory_pb2.TablesResponse(num_blocks=[len(t) for t in tables], blocks=[b for t in tables for b in t])

    def Stats(self, request, context):
        with self.lock:
            self._registered(context)
            stats = self._call(context, self.manager.stats)
            block_size = self.manager.geometry.block_size
        return convert.stats_to_proto(stats, block_size)

    def WatchBlocks(self, request, context):
        """Stream BlockEvents: a snapshot, then changes after each Reserve/Free (at least
        every `interval_s`), until the client goes away or memsvc stops."""
        interval = request.interval_s if request.interval_s > 0 else 1.0
        watch, seen = BlockWatch(), -1
        while context.is_active() and not self._stopped.is_set():
            with self.lock:
                ready = self.manager.planner is not None
                events = watch.next_events(self.manager, self.manager.pool_epoch) if ready else None
            if events is not None:
                yield events
            seen = self.block_changes.wait(seen, interval)

    def _registered(self, context) -> None:
        if self.manager.planner is None:
            context.abort(grpc.StatusCode.UNAVAILABLE,
                          "no executor has registered: the pool does not exist yet; retry")

    @staticmethod
    def _call(context, fn, *args):
        try:
            return fn(*args)
        except RuntimeError as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except (KeyError, ValueError) as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e).strip("'\""))


def _session(request, context) -> str:
    if not request.session_id:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                      "session_id is required: send one id per gateway process")
    return request.session_id


def serve(config: MemsvcConfig) -> int:
    """Run memsvc until SIGTERM/SIGINT; the shared-memory segment is unlinked on the way out."""
    from pagedserve.rpc.health_port import serve_health
    from pagedserve.rpc.metrics import serve_metrics
    from pagedserve.rpc.tracing import setup_tracing, shutdown_tracing

    try:
        memory = dataclasses.replace(config.memory, shared=True)
        credentials = config.tls.server_credentials()
        internal_auth.require_closed("memsvc", config.internal_token, config.tls,
                                     config.insecure_internal, log)
    except (ValueError, OSError) as e:
        print(f"memsvc: {e}", file=sys.stderr)
        return 2
    stop = stop_on_signals()
    setup_tracing("memsvc", config.tracing)
    servicer = MemoryService(MemoryManager(memory))
    # WatchBlocks streams hold a worker each; the token checked, and callers' roles with mutual TLS.
    service = Service([SERVICE_NAME], max_workers=16,
                      interceptors=[*internal_auth.interceptors(config.internal_token),
                                    *peer_auth.interceptors(config.tls, peer_auth.MEMSVC_POLICY)])
    memory_pb2_grpc.add_MemoryManagerServicer_to_server(servicer, service.server)
    health_server = channel = None
    try:
        address = service.start(config.host, config.port, credentials)
        channel = offer_step_channel(config, credentials, {"Reserve": (servicer.Reserve, memory_pb2.ReserveRequest)},
                                     inline=("Reserve",),  # one lock serializes it anyway
                                     token=config.internal_token)
        servicer.step_port = channel.port if channel is not None else 0
        serve_metrics(servicer.metrics.registry, config.host, config.metrics_port, log)
        health_server = serve_health(service.health, config.host, config.health_port, log)
        freeze_heap()
        service.set_serving(True)
        log.info("serving on %s (policy %s, preemption %s, swap space %g GiB, session lease %gs)",
                 address, memory.policy, memory.preemption_mode, memory.swap_space,
                 memory.session_lease)
        wait(stop)
        log.info("stopping")
    finally:
        if health_server is not None:
            health_server.stop(0)
        if channel is not None:
            channel.close()
        service.stop()
        servicer.close()
        shutdown_tracing()
    return 0
