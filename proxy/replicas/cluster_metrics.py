"""The ingress's /metrics: every replica's Prometheus metrics (reported with its routing stats)
and the ingress's own, each sample labelled ``replica`` (a replica's id, or ``ingress``), plus the
load gauges (vLLM's names and ours) over all replicas under ``replica="all"``: waiting and running summed, KV-cache usage
averaged (the replicas' caches are the same size). Dashboards sum per-replica series with
``replica!="all"``; a Kubernetes endpoint picker reads a single pod's own metrics instead."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

# The load gauges under vLLM's names and ours (proxy/server/metrics.py), the routing stat each
# comes from, how replicas add up, and whether the gauge carries vLLM's model_name label.
LOAD_GAUGES = {
    "vllm:num_requests_waiting": ("waiting", "sum", True),
    "vllm:num_requests_running": ("running", "sum", True),
    "vllm:kv_cache_usage_perc": ("kv_cache_usage", "mean", True),
    "foretell_num_requests_waiting": ("waiting", "sum", False),
    "foretell_num_requests_running": ("running", "sum", False),
    "foretell_kv_cache_usage_perc": ("kv_cache_usage", "mean", False),
}


class _Merged:
    """A collector yielding the merged families (a registry renders them in text format)."""

    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self):
        return iter(self.families)


def merge_metrics(model: str, own_text: str, stats: dict[str, dict]) -> bytes:
    """One exposition of ``own_text`` (labelled ingress) and each replica's reported metrics."""
    families: dict[str, Metric] = {}
    sources = [("ingress", own_text)] + [(replica, s.get("metrics", "")) for replica, s in sorted(stats.items())]
    for replica, text in sources:
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type,
                                                             family.unit))
            for sample in family.samples:
                merged.samples.append(sample._replace(labels={**sample.labels, "replica": replica}))
    for name, (stat, combine, named) in LOAD_GAUGES.items():
        values = [s[stat] for s in stats.values() if stat in s]
        if values:
            family = families.setdefault(name, Metric(name, f"{name} over all replicas", "gauge"))
            total = sum(values) if combine == "sum" else sum(values) / len(values)
            labels = {"model_name": model, "replica": "all"} if named else {"replica": "all"}
            family.samples.append(Sample(name, labels, total))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(list(families.values())))
    return generate_latest(registry)

