"""Several executor replicas behind one gateway: one step runner each, routed requests, failover.

A replica is one memsvc and one executor with their own pool. `ReplicaSet` has the face of
a StepRunner (submit, abort, stop), so the Generation service and the HTTP API use it
unchanged:
- `submit` asks the Router for a replica among those up and queues the request on that
  replica's step runner; the decision goes on the request's span.
- A probe thread connects replicas that are not up yet (a replica that appears is used)
  and checks the health of those that are. A replica whose probe fails, or whose step
  starts failing (pagedserve.gateway.step_retry reports a retry), is dropped from routing, and its
  requests are submitted again on another replica: recomputed from the prompt, with the
  tokens already streamed skipped, so greedy output is the same as without the failure.
  Requests that find no replica up wait for one.
- Drain: a replica whose probe answers NOT_SERVING (`Draining`: an executor told to stop,
  pagedserve.executor.server's --drain-timeout) gets no new requests; those it runs go on there. If it
  then fails, they move as above; if it says SERVING again, it is routed to again.
- `in_flight()` and `end_all(message)` as a StepRunner's: the requests not yet ended, on any
  replica or waiting for one; ending them all (a draining gateway at its deadline).
- With `discover` (pagedserve.gateway.discovery: a DNS name of all replicas), the probe thread asks
  it again every `discover_s` seconds and adds the replicas it has not seen.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable

from pagedserve.gateway.block_index import BlockIndex
from pagedserve.gateway.router import Router
from pagedserve.gateway.step_runner import BackendError, describe

log = logging.getLogger("pagedserve.gateway")
MAX_ATTEMPTS = 4


class Draining(ConnectionError):
    """A replica answers but says NOT_SERVING: route nothing new to it, let its requests run."""


class Replica:
    def __init__(self, name: str, memsvc: str, executor: str):
        self.name, self.memsvc, self.executor = name, memsvc, executor
        self.backend = None  # pagedserve.gateway.generation_service.Backend once connected
        self.runner = None  # pagedserve.gateway.step_runner.StepRunner
        self.index: BlockIndex | None = None
        self.up = False
        self.draining = False  # up, but takes no new requests
        self.reported = False  # "not up" logged already

    def queued(self) -> int:
        scheduler = self.runner.loop.scheduler
        return len(scheduler.running) + len(scheduler.waiting)


@dataclass
class Routed:
    request_id: str
    prompt: list[int]
    sampling: Any
    sink: Callable
    priority: int
    salt: str | None = None
    replica: Replica | None = None
    attempt: int = 0
    emitted: dict[int, int] = field(default_factory=dict)  # tokens streamed, per completion
    seen: dict[int, int] = field(default_factory=dict)  # tokens of this attempt, per completion
    finished: int = 0


class ReplicaSet:
    def __init__(self, addresses: list[tuple[str, str]], connect: Callable[[str, str], Any],
                 make_runner: Callable[[Any, Callable], Any], router: Router, telemetry=None,
                 probe_s: float = 1.0, discover: Callable[[], list[tuple[str, str]]] | None = None,
                 discover_s: float = 5.0):
        self.replicas: list[Replica] = []
        for memsvc, executor in addresses:
            self.add(memsvc, executor)
        self.discover = discover
        self.discover_s = discover_s
        self._discovered_at = float("-inf")
        self.connect = connect
        self.make_runner = make_runner
        self.router = router
        self.telemetry = telemetry
        self.probe_s = probe_s
        self.on_change: Callable[[bool], None] | None = None  # called with "any replica up"
        self.backend = None  # the first replica's: model info and tokenizer
        self.info = None
        self._lock = threading.RLock()
        self._requests: dict[str, Routed] = {}
        self._stranded: list[Routed] = []  # waiting for a replica to come up
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._probe_loop, name="replica-probe", daemon=True)

    # -- bring-up ---------------------------------------------------------------------------------
    def add(self, memsvc: str, executor: str) -> Replica:
        """A replica to route to once it answers (the same addresses twice: the same replica)."""
        for replica in self.replicas:
            if (replica.memsvc, replica.executor) == (memsvc, executor):
                return replica
        replica = Replica(f"r{len(self.replicas)}", memsvc, executor)
        self.replicas = [*self.replicas, replica]  # readers iterate over a list never mutated
        return replica

    def _discover(self) -> None:
        if self.discover is None or time.monotonic() - self._discovered_at < self.discover_s:
            return
        self._discovered_at = time.monotonic()
        for memsvc, executor in self.discover():
            with self._lock:
                known = len(self.replicas)
                self.add(memsvc, executor)
                if len(self.replicas) > known:
                    log.info("discovered replica %s (memsvc %s, executor %s)", self.replicas[-1].name,
                             memsvc, executor)

    def connect_any(self) -> "ReplicaSet":
        """Connect the replicas that answer; raise unless one does. Then keep probing."""
        self._discover()
        for replica in self.replicas:
            self._try_connect(replica)
        if not any(r.up for r in self.replicas):
            raise ConnectionError("no replica answers yet: " +
                                  ", ".join(f"{r.memsvc}+{r.executor}" for r in self.replicas))
        if not self._thread.is_alive():
            self._thread.start()
        return self

    def _try_connect(self, replica: Replica) -> None:
        if replica.backend is None:
            try:
                backend = self.connect(replica.memsvc, replica.executor)
            except Exception as e:
                if not replica.reported:  # once, not on every probe
                    log.info("replica %s (%s, %s) not up: %s", replica.name, replica.memsvc,
                             replica.executor, describe(e))
                replica.reported = True
                return
            replica.backend = backend
            replica.index = BlockIndex(backend.memory.channel)
            replica.runner = self.make_runner(backend, lambda e, r=replica: self._failed(r, e))
            if self.backend is None:
                self.backend, self.info = backend, replica.runner.loop.info
        try:
            replica.backend.probe()
        except Exception:
            return
        with self._lock:
            if not replica.up:
                log.info("replica %s up (memsvc %s, executor %s)", replica.name, replica.memsvc,
                         replica.executor)
            if not any(r.up for r in self.replicas) and self.on_change is not None:
                self.on_change(True)
            replica.up = True
            replica.draining = False
            self._route_stranded()

    def _route_stranded(self) -> None:
        if self.routable():
            stranded, self._stranded = self._stranded, []
            for routed in stranded:
                self._place(routed, "failover")

    def _probe_loop(self) -> None:
        while not self._stopped.wait(self.probe_s):
            self._discover()
            for replica in self.replicas:
                if self._stopped.is_set():
                    return
                if not replica.up:
                    self._try_connect(replica)
                else:
                    self.probe(replica)

    def probe(self, replica: Replica) -> None:
        """Check a replica that is up: draining, serving again, or failed."""
        try:
            replica.backend.probe()
        except Draining as e:
            with self._lock:
                if replica.up and not replica.draining:
                    replica.draining = True
                    running = sum(r.replica is replica for r in self._requests.values())
                    log.info("replica %s draining (%s): no new requests, %d running go on",
                             replica.name, describe(e), running)
            return
        except Exception as e:
            self._failed(replica, e)
            return
        if replica.draining:
            with self._lock:
                replica.draining = False
                self._route_stranded()
            log.info("replica %s serving again", replica.name)

    def routable(self) -> list[Replica]:
        """The replicas that take new requests: up and not draining."""
        return [r for r in self.replicas if r.up and not r.draining]

    # -- the StepRunner face ------------------------------------------------------------------------
    def submit(self, request_id: str, prompt_token_ids: list[int], sampling, sink, priority: int = 0,
               salt: str | None = None) -> Future:
        routed = Routed(request_id, list(prompt_token_ids), sampling, sink, priority, salt)
        with self._lock:
            self._requests[request_id] = routed
            up = self.routable()
            if not up:  # wait for one (the client's deadline still applies)
                self._stranded.append(routed)
                done: Future = Future()
                done.set_result(None)
                return done
            route = self.router.choose(up, routed.prompt, salt=routed.salt)
            self._record(request_id, route)
            done = self._submit_to(routed, route.replica)
        done.add_done_callback(lambda f: f.exception() is not None and self._forget(routed))
        return done

    def _forget(self, routed: Routed) -> None:
        """A request its replica refused (bad request, full queue): the caller hears why."""
        with self._lock:
            if self._requests.get(routed.request_id) is routed:
                del self._requests[routed.request_id]

    def queues(self):
        """The replicas' scheduler queues together (for the gateway's queue gauges)."""
        schedulers = [r.runner.loop.scheduler for r in self.replicas if r.runner is not None]
        return SimpleNamespace(**{name: [s for sched in schedulers for s in list(getattr(sched, name, []))]
                                  for name in ("running", "waiting", "swapped")})

    def abort(self, request_id: str) -> None:
        with self._lock:
            routed = self._requests.pop(request_id, None)
            if routed is not None and routed.replica is not None:
                routed.replica.runner.abort(request_id)
            if routed in self._stranded:
                self._stranded.remove(routed)

    def in_flight(self) -> int:
        return len(self._requests)

    def end_all(self, message: str) -> None:
        with self._lock:
            ending, self._requests, self._stranded = list(self._requests.values()), {}, []
            for routed in ending:
                if routed.replica is not None:
                    routed.replica.runner.abort(routed.request_id)
                routed.sink(BackendError(message))

    def stop(self, timeout: float = 5.0) -> None:
        self._stopped.set()
        for replica in self.replicas:
            if replica.runner is not None:
                replica.runner.stop(timeout)
            if replica.index is not None:
                replica.index.close()
            for client in (replica.backend.memory, replica.backend.executor) if replica.backend else ():
                client.close()

    # -- routing and failover -----------------------------------------------------------------------
    def _record(self, request_id: str, route) -> None:
        record = self.telemetry.open.get(request_id) if self.telemetry is not None else None
        if record is not None:
            record.span.set_attributes(route.attributes())

    def _submit_to(self, routed: Routed, replica: Replica) -> Future:
        routed.replica = replica
        routed.attempt += 1
        routed.seen = {}
        attempt = routed.attempt
        return replica.runner.submit(routed.request_id, routed.prompt, routed.sampling,
                                     lambda item: self._deliver(routed, attempt, item), routed.priority,
                                     **({"salt": routed.salt} if routed.salt is not None else {}))

    def _place(self, routed: Routed, reason: str) -> None:
        """Submit a request again on a replica that takes requests (or keep it until one does)."""
        up = self.routable()
        if routed.attempt >= MAX_ATTEMPTS or not up:
            if routed.attempt >= MAX_ATTEMPTS:
                self._requests.pop(routed.request_id, None)
                routed.sink(BackendError("the request failed on every replica it was sent to"))
            else:
                routed.replica = None
                self._stranded.append(routed)
            return
        route = self.router.choose(up, routed.prompt, reason, salt=routed.salt)
        log.info("request %s moves to replica %s", routed.request_id, route.replica.name)
        done = self._submit_to(routed, route.replica)
        done.add_done_callback(lambda f: f.exception() and self._deliver(routed, routed.attempt,
                                                                          f.exception()))

    def _failed(self, replica: Replica, error: BaseException) -> None:
        """Drop `replica` from routing and move its requests (step thread or probe thread)."""
        with self._lock:
            if not replica.up:
                return
            replica.up = False
            replica.draining = False
            if not any(r.up for r in self.replicas) and self.on_change is not None:
                self.on_change(False)
            moving = [r for r in self._requests.values() if r.replica is replica]
            log.warning("replica %s down (%s): moving %d requests", replica.name, describe(error),
                        len(moving))
            for routed in moving:
                replica.runner.abort(routed.request_id)
                self._place(routed, "failover")

    def _deliver(self, routed: Routed, attempt: int, item) -> None:
        """A step's deltas (or an error) for one attempt; stale attempts are dropped."""
        with self._lock:
            if routed.attempt != attempt or self._requests.get(routed.request_id) is not routed:
                return
            if isinstance(item, BaseException):
                if isinstance(item, BackendError) and routed.replica is not None:
                    self._failed(routed.replica, item)
                    return
                self._requests.pop(routed.request_id, None)
                routed.sink(item)
                return
            fresh = []
            for d in item:
                seen = routed.seen.get(d.index, 0) + len(d.token_ids)
                routed.seen[d.index] = seen
                if seen <= routed.emitted.get(d.index, 0) and not d.finish_reason:
                    continue  # streamed before the move: recomputed identically
                routed.emitted[d.index] = max(seen, routed.emitted.get(d.index, 0))
                routed.finished += bool(d.finish_reason)
                fresh.append(d)
            if routed.finished >= routed.sampling.n:
                self._requests.pop(routed.request_id, None)
            if fresh:
                routed.sink(fresh)
