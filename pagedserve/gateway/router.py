"""Choose the replica for a new request: prefix-cache affinity against load, or round-robin.

`prefix` scores each replica that is up as

    score = cached_fraction - LOAD_WEIGHT * load

where cached_fraction is the share of the prompt covered by the leading blocks the
replica already holds (pagedserve.gateway.block_index) and load is its KV usage plus its queue
(running and waiting sequences over max_num_seqs). The highest score wins; ties go to the
next replica in turn. `round-robin` takes the replicas in turn (the baseline).

Every decision is counted in `pagedserve:routing_decisions{replica,reason}` and returned
as a Route whose `attributes()` go on the request's span.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Sequence

from prometheus_client import CollectorRegistry, Counter

from pagedserve.wire.block_keys import cacheable_blocks, prompt_block_keys

POLICIES = ("prefix", "round-robin")
LOAD_WEIGHT = 0.5


@dataclass
class Route:
    replica: Any  # pagedserve.gateway.replica_set.Replica
    reason: str  # prefix (a replica held some of the prompt), load, round-robin, failover
    cached_blocks: int
    score: float
    keys: list[bytes]

    def attributes(self) -> dict:
        return {"pagedserve.route.replica": self.replica.name, "pagedserve.route.reason": self.reason,
                "pagedserve.route.cached_blocks": self.cached_blocks,
                "pagedserve.route.score": round(self.score, 4)}


class RoutingMetrics:
    def __init__(self, registry: CollectorRegistry | None):
        self.decisions = Counter("pagedserve:routing_decisions", "New requests routed, by replica and "
                                 "reason (prefix, load, round-robin, failover).",
                                 ["replica", "reason"], registry=registry)
        self.cached_blocks = Counter("pagedserve:routing_cached_blocks", "Prompt blocks the chosen "
                                     "replica already held when a request was routed.", registry=registry)


class Router:
    def __init__(self, policy: str = "prefix", block_size: int = 16, max_num_seqs: int = 64,
                 registry: CollectorRegistry | None = None):
        if policy not in POLICIES:
            raise ValueError(f"routing must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.policy = policy
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.metrics = RoutingMetrics(registry)
        self._turn = itertools.count()

    def load(self, replica) -> float:
        return replica.index.kv_usage() + replica.queued() / self.max_num_seqs

    def choose(self, replicas: Sequence, prompt: list[int], reason: str | None = None,
               salt: str | None = None) -> Route:
        """The replica for `prompt` (under cache `salt`) among `replicas` (all up, at least one)."""
        if not replicas:
            raise LookupError("no replica is up")
        turn = next(self._turn)
        keys = prompt_block_keys(prompt, self.block_size, salt,
                                 max_blocks=cacheable_blocks(len(prompt), self.block_size))
        if self.policy == "round-robin":
            replica = replicas[turn % len(replicas)]
            route = Route(replica, reason or "round-robin", replica.index.leading(keys), 0.0, keys)
        else:
            n = len(replicas)
            best = None
            for i in range(n):  # start at this turn's replica so that ties rotate
                replica = replicas[(turn + i) % n]
                cached = replica.index.leading(keys)
                score = cached * self.block_size / max(len(prompt), 1) - LOAD_WEIGHT * self.load(replica)
                if best is None or score > best.score + 1e-9:
                    best = Route(replica, reason or ("prefix" if cached else "load"), cached, score, keys)
            route = best
        route.replica.index.note_routed(keys)
        self.metrics.decisions.labels(route.replica.name, route.reason).inc()
        self.metrics.cached_blocks.inc(route.cached_blocks)
        return route
