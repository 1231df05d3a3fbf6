"""The gateway's Prometheus metrics: requests, latencies, tokens, preemptions, queue depth.

Queue gauges (`num_requests_running|waiting|swapped`) are read from the scheduler at scrape
time and count requests (a request with n samples counts once, as running when any of its
sequences runs). Everything else is updated as requests finish and steps run. Those vLLM
also exports are exported under its names too, labelled model_name (pagedserve.gateway.metrics_vllm).
"""
from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from pagedserve.gateway.metrics_vllm import VllmView
from pagedserve.rpc.metrics import LATENCY_BUCKETS, STEP_BUCKETS, TPOT_BUCKETS, TTFT_BUCKETS, new_registry


class _QueueCollector:
    def __init__(self, scheduler: Callable[[], object]):
        self.scheduler = scheduler

    def collect(self):
        sched = self.scheduler()
        running = waiting = swapped = set()
        if sched is not None:
            running = {s.request_id for s in list(sched.running)}
            swapped = {s.request_id for s in list(getattr(sched, "swapped", []))} - running
            waiting = {s.request_id for s in list(sched.waiting)} - running - swapped
        for name, ids, what in (("running", running, "with a sequence in the current batch"),
                                ("waiting", waiting, "waiting to be scheduled (new or preempted)"),
                                ("swapped", swapped, "preempted to the host swap space")):
            yield GaugeMetricFamily(f"pagedserve:num_requests_{name}", f"Requests {what}.", value=len(ids))


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        r = registry if registry is not None else new_registry()
        self.registry = r
        self.ttft = Histogram("pagedserve:time_to_first_token_seconds",
                              "Time from arrival to the first output token.", buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("pagedserve:time_per_output_token_seconds",
                              "Mean time between output tokens after the first, per request.",
                              buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("pagedserve:e2e_request_latency_seconds",
                             "Time from arrival to the last token (finished requests).",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("pagedserve:request_queue_time_seconds",
                                    "Time from arrival to the first step that computes the request.",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.step_time = Histogram("pagedserve:step_execute_seconds", "Wall time of a step's Execute "
                                   "call as the gateway sees it.", buckets=STEP_BUCKETS, registry=r)
        self.prompt_tokens = Counter("pagedserve:prompt_tokens", "Prompt tokens of admitted requests.",
                                     registry=r)
        self.generation_tokens = Counter("pagedserve:generation_tokens", "Output tokens streamed.",
                                         registry=r)
        self.success = Counter("pagedserve:request_success", "Requests finished, by finish reason.",
                               ["finished_reason"], registry=r)
        self.errors = Counter("pagedserve:request_errors", "Requests ended with an error status, "
                              "by gRPC status code.", ["code"], registry=r)
        self.preemptions = Counter("pagedserve:num_preemptions", "Sequences preempted, by mode "
                                   "(swap or recompute).", ["mode"], registry=r)
        self.step_retries = Counter("pagedserve:step_retries", "Reserve or Execute calls retried while "
                                    "a backend service restarted.", ["call"], registry=r)
        for mode in ("swap", "recompute"):
            self.preemptions.labels(mode)
        for call in ("reserve", "execute"):
            self.step_retries.labels(call)
        self._scheduler: Callable[[], object] = lambda: None
        self.model_name = ""
        queues = _QueueCollector(lambda: self._scheduler())
        r.register(queues)
        r.register(VllmView([queues, self.ttft, self.tpot, self.e2e, self.queue_time, self.prompt_tokens,
                             self.generation_tokens, self.success, self.preemptions],
                            lambda: self.model_name))

    def watch_scheduler(self, scheduler: Callable[[], object], model_name: str = "") -> None:
        """Read the queue gauges from `scheduler()` (a pagedserve.gateway.scheduler.Scheduler or None);
        the vLLM-named metrics are labelled `model_name` (none are exported before one is given)."""
        self._scheduler = scheduler
        self.model_name = model_name
