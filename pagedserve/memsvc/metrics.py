"""memsvc's Prometheus metrics, read from the MemoryManager at scrape time.

- pagedserve:kv_cache_usage_perc: referenced blocks / all blocks (0..1; cached blocks with
  no holder count as free, as in vLLM)
- pagedserve:token_state_fraction: slots holding a token's K/V / all slots (the useful part)
- pagedserve:kv_cache_blocks{state=free|cached|referenced}, pagedserve:kv_cache_slots{state=...}
- pagedserve:prefix_cache_queries_total / _hits_total: prompt tokens looked up / found
- pagedserve:memsvc_preemptions_total{mode=swap|recompute}
- pagedserve:host_tier_blocks{state=used|free}: the prefix cache's host tier (--kv-offload)
- pagedserve:host_tier_lookups_total / _hits_total: blocks looked up there past the pool's
  hits / found; _offloaded_total / _restored_total: blocks copied out / in;
  pagedserve:host_tier_tokens_restored_total: prompt tokens not recomputed thanks to it
- pagedserve:num_sequences, pagedserve:num_sessions
- pagedserve:reserve_seconds: time memsvc spends in one Reserve
Before an executor registers (no pool yet) only the histogram is exported.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pagedserve.rpc.metrics import STEP_BUCKETS, new_registry

SLOT_STATES = ("token_state", "reserved", "internal_fragmentation", "external_fragmentation", "free")


class MemsvcCollector:
    def __init__(self, service):
        self.service = service  # pagedserve.memsvc.server.MemoryService: its manager and lock

    def collect(self):
        service = self.service
        with service.lock:
            if service.manager.planner is None:
                return
            stats = service.manager.stats()
        snap = stats.snapshot
        blocks = snap["num_blocks"] or 1
        yield GaugeMetricFamily("pagedserve:kv_cache_usage_perc",
                                "Fraction of KV blocks referenced by sequences (1 = full).",
                                value=snap["blocks_referenced"] / blocks)
        yield GaugeMetricFamily("pagedserve:token_state_fraction",
                                "Fraction of the pool's slots holding a token's K/V.",
                                value=snap["token_state_fraction"])
        g = GaugeMetricFamily("pagedserve:kv_cache_blocks", "KV blocks by state.", labels=["state"])
        for state in ("free", "cached", "referenced"):
            g.add_metric([state], snap[f"blocks_{state}"])
        yield g
        g = GaugeMetricFamily("pagedserve:kv_cache_slots", "KV slots by what they hold.", labels=["state"])
        for state in SLOT_STATES:
            g.add_metric([state], snap[state])
        yield g
        yield CounterMetricFamily("pagedserve:prefix_cache_queries", "Prompt tokens looked up in "
                                  "the prefix cache.", value=stats.prefix_cache_queries)
        yield CounterMetricFamily("pagedserve:prefix_cache_hits", "Prompt tokens found in the "
                                  "prefix cache.", value=stats.prefix_cache_hits)
        p = stats.preemption
        c = CounterMetricFamily("pagedserve:memsvc_preemptions", "Sequences preempted by memsvc, "
                                "by mode.", labels=["mode"])
        swapped = p.get("num_swapped_out", 0)
        c.add_metric(["swap"], swapped)
        c.add_metric(["recompute"], p.get("num_recomputed", stats.num_preemptions - swapped))
        yield c
        if p.get("host_tier_blocks"):
            g = GaugeMetricFamily("pagedserve:host_tier_blocks", "Blocks of the prefix cache's host "
                                  "tier, by state.", labels=["state"])
            g.add_metric(["used"], p["host_tier_blocks_used"])
            g.add_metric(["free"], p["host_tier_blocks"] - p["host_tier_blocks_used"])
            yield g
            for name, what in (("lookups", "Blocks looked up in the host tier past the pool's hits."),
                               ("hits", "Blocks found in the host tier."),
                               ("offloaded", "Evicted cached blocks copied to the host tier."),
                               ("restored", "Host-tier blocks copied back into the pool."),
                               ("tokens_restored", "Prompt tokens not recomputed thanks to the "
                                                   "host tier.")):
                yield CounterMetricFamily(f"pagedserve:host_tier_{name}", what,
                                          value=p[f"host_tier_{name}"])
        yield GaugeMetricFamily("pagedserve:num_sequences", "Sequences holding blocks.",
                                value=stats.num_sequences)
        yield GaugeMetricFamily("pagedserve:num_sessions", "Gateway sessions with a live lease.",
                                value=stats.num_sessions)


class MemsvcMetrics:
    def __init__(self, service, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else new_registry()
        self.reserve_time = Histogram("pagedserve:reserve_seconds", "Time memsvc spends in one "
                                      "Reserve (copies included).", buckets=STEP_BUCKETS,
                                      registry=self.registry)
        self.registry.register(MemsvcCollector(service))
