"""One metrics view over data-parallel replicas (replica_metrics.py): totals where the replicas
counted under different labels (launches by step shape), each replica's own dict beside them."""

from __future__ import annotations

from nori_jax.core.outputs import EngineCoreOutputs, StepStats
from nori_jax.metrics import EngineMetrics
from nori_jax.replica_metrics import ReplicaMetrics


def _step(*launches: tuple[int, str, float]) -> EngineCoreOutputs:
    out = EngineCoreOutputs.empty()
    out.stats = StepStats(3, 0, 0.5, 3, 0, 0, 0, 0, 0.001, 0.01, 1, launches=list(launches))
    return out


def test_labelled_counters_add_up_over_replicas_that_counted_different_labels():
    a, b = EngineMetrics(), EngineMetrics()
    a.observe(_step((16, "decode", 0.004)))
    b.observe(_step((32, "mixed", 0.010)))
    b.observe(_step((16, "decode", 0.006)))
    view = ReplicaMetrics([a, b]).as_dict()
    assert view["nori:step_launches_total"] == {"16/decode": 2.0, "32/mixed": 1.0}
    seconds = view["nori:step_launch_seconds_total"]
    assert seconds.keys() == {"16/decode", "32/mixed"}
    assert abs(seconds["16/decode"] - 0.010) < 1e-12 and abs(seconds["32/mixed"] - 0.010) < 1e-12
    assert view["nori:generation_tokens_total"] == 9.0
    assert [r["nori:step_launches_total"] for r in view["replicas"]] == [
        {"16/decode": 1.0},
        {"32/mixed": 1.0, "16/decode": 1.0},
    ]


def test_a_name_only_one_replica_has_is_kept():
    a, b = EngineMetrics(), EngineMetrics()
    b.observe(_step((64, "prefill", 0.02)))
    view = ReplicaMetrics([a, b]).as_dict()
    assert view["nori:step_launches_total"] == {"64/prefill": 1.0}
