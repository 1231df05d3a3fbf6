"""One scrape for the whole replica: the gateway's metrics plus its upstreams' (memsvc's and
the executor's /metrics), served as `GET /metrics` on the HTTP API port.

Contract: `ReplicaMetrics.render()` returns the Prometheus text exposition of the
gateway's registry and of every upstream (name, url), fetched concurrently at scrape time
(timeout `timeout_s` each), with the vLLM-named copies of the upstreams' families that
vLLM also exports (pagedserve.gateway.metrics_vllm; labelled `model_name()`). Each upstream sample gets
the label `service="<name>"`, so
families that several processes export (process_*, python_gc_*) stay apart; families of
the same name are merged into one (one HELP/TYPE). `pagedserve:metrics_upstream_up{service}`
is 1 for an upstream that answered and 0 for one that did not (its samples are then
missing from this scrape, not stale).
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.gateway.metrics_vllm import vllm_families

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _Merged:
    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self):
        return self.families


def _labelled(family: Metric, service: str) -> Metric:
    out = Metric(family.name, family.documentation, family.type, family.unit)
    out.samples = [s._replace(labels={**s.labels, "service": service}) for s in family.samples]
    return out


def merge(own: list[Metric], upstream: dict[str, list[Metric]], model_name: str = "") -> bytes:
    """The text exposition of `own` families plus each upstream's, labelled by service, and,
    once `model_name` is known, the upstreams' under vLLM's names too."""
    by_name: dict[str, Metric] = {}
    order: list[str] = []

    def add(family: Metric) -> None:
        have = by_name.get(family.name)
        if have is None:
            by_name[family.name] = family
            order.append(family.name)
        elif have.type == family.type:
            have.samples = list(have.samples) + list(family.samples)
        # a family of the same name but another type cannot share a name: keep the first

    for family in own:
        add(family)
    up = GaugeMetricFamily("pagedserve:metrics_upstream_up", "1 if the upstream's /metrics "
                           "answered this scrape.", labels=["service"])
    for service, families in upstream.items():
        up.add_metric([service], 0 if families is None else 1)
        labelled = [_labelled(family, service) for family in families or []]
        for family in labelled + (vllm_families(labelled, model_name) if model_name else []):
            add(family)
    if upstream:
        add(up)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged([by_name[n] for n in order]))
    return generate_latest(registry)


class ReplicaMetrics:
    def __init__(self, registry: CollectorRegistry, upstreams: list[tuple[str, str]] | None = None,
                 timeout_s: float = 2.0, model_name: Callable[[], str] = str):
        self.registry = registry
        self.upstreams = list(upstreams or [])
        self.timeout_s = timeout_s
        self.model_name = model_name

    async def _fetch(self, client: httpx.AsyncClient, url: str) -> list[Metric] | None:
        try:
            r = await client.get(url)
            r.raise_for_status()
            return list(text_string_to_metric_families(r.text))
        except (httpx.HTTPError, ValueError):
            return None

    async def render(self) -> bytes:
        upstream: dict[str, list[Metric] | None] = {}
        if self.upstreams:
            async with httpx.AsyncClient(timeout=self.timeout_s) as client:
                results = await asyncio.gather(*(self._fetch(client, url) for _, url in self.upstreams))
            upstream = {name: fams for (name, _), fams in zip(self.upstreams, results)}
        return merge(list(self.registry.collect()), upstream, self.model_name())
