"""The metrics under vLLM's names too, for vLLM's Grafana dashboards and the tools that read
them (the Gateway API Inference Extension's defaults among them): each `pagedserve:*` family
of VLLM_NAMES is also exported under the vLLM name(s) it maps to, the same samples with a
`model_name` label (the served model's name). The gateway's own families are renamed at
scrape time by `VllmView` (pagedserve.gateway.metrics); memsvc's (the KV cache usage, the prefix cache
counters) as the gateway's /metrics merges them in (pagedserve.gateway.metrics_proxy)."""
from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client.core import Metric

VLLM_NAMES: dict[str, tuple[str, ...]] = {
    "pagedserve:num_requests_running": ("vllm:num_requests_running",),
    "pagedserve:num_requests_waiting": ("vllm:num_requests_waiting",),
    "pagedserve:num_requests_swapped": ("vllm:num_requests_swapped",),
    "pagedserve:prompt_tokens": ("vllm:prompt_tokens",),
    "pagedserve:generation_tokens": ("vllm:generation_tokens",),
    "pagedserve:request_success": ("vllm:request_success",),
    "pagedserve:num_preemptions": ("vllm:num_preemptions",),
    "pagedserve:time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
    # a request's mean time per output token after the first: vLLM's older and current names
    "pagedserve:time_per_output_token_seconds": ("vllm:time_per_output_token_seconds",
                                                 "vllm:request_time_per_output_token_seconds"),
    "pagedserve:e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
    "pagedserve:request_queue_time_seconds": ("vllm:request_queue_time_seconds",),
    # memsvc's, merged into the gateway's /metrics; gpu_cache_usage_perc: vLLM's name until v0.8
    "pagedserve:kv_cache_usage_perc": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "pagedserve:prefix_cache_queries": ("vllm:prefix_cache_queries",),
    "pagedserve:prefix_cache_hits": ("vllm:prefix_cache_hits",),
}


def vllm_families(families: Iterable[Metric], model_name: str) -> list[Metric]:
    """Copies of the VLLM_NAMES families among `families`, renamed, labelled model_name."""
    out = []
    for family in families:
        for name in VLLM_NAMES.get(family.name, ()):
            copy = Metric(name, family.documentation, family.type, family.unit)
            copy.samples = [s._replace(name=name + s.name[len(family.name):],
                                       labels={**s.labels, "model_name": model_name})
                            for s in family.samples]
            out.append(copy)
    return out


class VllmView:
    """A collector: the vLLM-named copies of `sources`' families (collectors of the same
    registry, which it must not include), once `model_name()` names the model."""

    def __init__(self, sources: list, model_name: Callable[[], str]):
        self.sources = sources
        self.model_name = model_name

    def collect(self):
        name = self.model_name()
        if not name:
            return []
        return vllm_families((f for source in self.sources for f in source.collect()), name)
