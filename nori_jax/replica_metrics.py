"""One metrics view over data-parallel replicas: every `nori:*` series with a `replica` label.

Each replica keeps its own `EngineMetrics` (fed by its own core's outputs, in whichever process
or thread reads them), so nothing is shared between their writers. The view's registry collects
them all at scrape time and adds `replica="i"` to each sample, the way vLLM labels its engines:

    nori:generation_tokens_total{replica="0"} 120.0
    nori:generation_tokens_total{replica="1"} 98.0

so `sum by (...)` in PromQL gives the server's totals. `as_dict()` (`LLM.get_metrics()`) gives the
totals directly, with the same keys as one engine's, plus each replica's own under "replicas".
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

from nori_jax.metrics import EngineMetrics

# Gauges whose total over replicas means nothing: averaged, or the largest, instead of summed.
_MEAN = ("nori:kv_cache_usage_perc",)
_MAX = ("nori:engine_recovery_seconds",)


class _LabelledUnion:
    """A prometheus_client collector: the replicas' families, merged, each sample labelled."""

    def __init__(self, replicas: list[EngineMetrics]):
        self.replicas = replicas

    def collect(self):
        merged: dict[str, Metric] = {}
        for i, m in enumerate(self.replicas):
            for family in m.registry.collect():
                out = merged.get(family.name)
                if out is None:
                    out = Metric(family.name, family.documentation, family.type, family.unit)
                    merged[family.name] = out
                for s in family.samples:
                    out.samples.append(s._replace(labels={**s.labels, "replica": str(i)}))
        yield from merged.values()


class ReplicaMetrics:
    def __init__(self, replicas: list[EngineMetrics]):
        if not replicas:
            raise ValueError("ReplicaMetrics needs at least one replica's metrics")
        self.replicas = replicas
        self.registry = CollectorRegistry()
        self.registry.register(_LabelledUnion(replicas))

    def as_dict(self) -> dict[str, Any]:
        """The replicas' metrics as one engine's: counters and histograms summed, gauges summed
        (KV usage averaged, the last recovery time the largest); each replica's own dict under
        "replicas"."""
        each = [m.as_dict() for m in self.replicas]
        out: dict[str, Any] = {}
        # A labelled counter has a key only once a replica counted something under it (step
        # launches by shape): a name or label one replica lacks counts 0 there.
        names = list(dict.fromkeys(name for d in each for name in d))
        for name in names:
            values = [d[name] for d in each if name in d]
            first = values[0]
            if isinstance(first, dict):
                if all(isinstance(v, (int, float)) for d in values for v in d.values()):
                    keys = dict.fromkeys(k for d in values for k in d)
                    out[name] = {k: sum(d.get(k, 0.0) for d in values) for k in keys}
                else:
                    out[name] = first  # an info: every replica runs the same model
            elif name in _MEAN:
                out[name] = sum(values) / len(values)
            elif name in _MAX:
                out[name] = max(values)
            else:
                out[name] = sum(values)
        out["replicas"] = each
        return out
