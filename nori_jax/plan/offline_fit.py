"""The mixed-step device term, fitted to a measured offline run of the same workload.

`plan calibrate` now fits this term to its own mixed steps (calibrate.py: large decode batches
beside prompts); this fit is the cross-check, and the way to give the term to files recorded
before (which have none: 0). Where both exist the calibrated term wins (`calibrated_mixed_kv`;
benchmarks/plan/fit_mixed_kv.py prints the offline fit beside it and keeps it).

The calibrations of 2026-12-03 modelled a step as the sum of a decode part and a prefill part.
On the H200 the steps that mix a large decode
batch with a prefill chunk ran longer than that: `bench offline` runs, which the simulator
replays step for step (every request queued at once: the same decisions, the same step count),
had a TPOT (the time of the steps a decoding request sits in) 5-10% above the replay's, while
the calibration's own overlapped decode-only checks were replayed within 7%. Served near the
knee every step is such a mixed step, and the gap grows with the load: a longer step holds more
requests, which makes it longer still (docs/planning.md, "How close it is").

`fit_mixed_kv` finds the device seconds per `mixed_decode_kv_tokens` (features.py) that make the
simulated offline run's median TPOT the measured one. With every request queued at once the
scheduler's decisions do not depend on time, so that TPOT grows with the coefficient and a
bisection finds it; a measured TPOT at or below the replay's gives 0 (the term is a cost, never a
saving).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

from nori_jax.plan.calibration import Calibration
from nori_jax.plan.step_model import MIXED_KV_TERM, LinearModel

TERM = MIXED_KV_TERM
OFFLINE_NOTE = "from the offline fit to"  # in the source of a calibration whose term this set


def calibrated_mixed_kv(cal: Calibration) -> float | None:
    """The term `plan calibrate` fitted to the calibration's own mixed steps (0 if they showed
    none), or None: a file recorded before calibrate fitted it (no term, which is 0, or one set
    by this module's offline fit)."""
    coef = cal.costs.device.to_dict().get(TERM)
    if coef is None or not cal.feature_max.get(TERM) or OFFLINE_NOTE in cal.source:
        return None
    return coef


def with_mixed_kv(cal: Calibration, seconds_per_token: float, note: str = "") -> Calibration:
    """`cal` with its device model's mixed-step term set (added, or replaced)."""
    if not (math.isfinite(seconds_per_token) and seconds_per_token >= 0):
        raise ValueError(f"the mixed-step term must be finite and >= 0, got {seconds_per_token}")
    terms = dict(cal.costs.device.to_dict())
    terms[TERM] = float(seconds_per_token)
    device = LinearModel(tuple(terms), tuple(terms.values()))
    source = cal.source + (
        f"; {TERM} {seconds_per_token:.3g} s {OFFLINE_NOTE} {note}" if note else ""
    )
    return dataclasses.replace(
        cal, costs=dataclasses.replace(cal.costs, device=device), source=source
    )


@dataclasses.dataclass(frozen=True)
class MixedFit:
    seconds_per_token: float
    measured_tpot_ms: float
    simulated_tpot_ms: float  # with the fitted term
    without_term_ms: float  # the replay without it
    steps: int


def fit_mixed_kv(
    cal: Calibration,
    run_offline: Callable[[Calibration], tuple[float, int]],
    measured_tpot_ms: float,
    measured_steps: int | None = None,
    rel_tol: float = 0.005,
    max_iterations: int = 40,
) -> MixedFit:
    """The term's coefficient that makes `run_offline(cal)` -> (median TPOT ms, steps) give
    `measured_tpot_ms`. `measured_steps`, if given, must be the replay's step count: another
    count means another workload or engine, whose TPOT says nothing about the steps' cost."""
    if not measured_tpot_ms > 0:
        raise ValueError(f"the measured TPOT must be > 0, got {measured_tpot_ms}")
    base_ms, steps = run_offline(with_mixed_kv(cal, 0.0))
    if measured_steps is not None and steps != measured_steps:
        raise ValueError(
            f"the offline run took {measured_steps} steps but its replay {steps}: not the same "
            "workload and engine (the same --num-prompts, seed and engine flags are needed)"
        )
    if measured_tpot_ms <= base_ms:
        return MixedFit(0.0, measured_tpot_ms, base_ms, base_ms, steps)
    lo, hi, hi_ms = 0.0, 1e-9, None
    for _ in range(max_iterations):  # double until the replay is slower than measured
        hi_ms, _ = run_offline(with_mixed_kv(cal, hi))
        if hi_ms >= measured_tpot_ms:
            break
        lo, hi = hi, 2 * hi
    else:
        raise ValueError(
            f"no mixed-step term up to {hi:.3g} s per KV token brings the replay's TPOT "
            f"({hi_ms:.2f} ms) to the measured {measured_tpot_ms:.2f} ms"
        )
    best, best_ms = hi, hi_ms
    for _ in range(max_iterations):
        if abs(best_ms - measured_tpot_ms) <= rel_tol * measured_tpot_ms:
            break
        mid = (lo + hi) / 2
        mid_ms, _ = run_offline(with_mixed_kv(cal, mid))
        if mid_ms < measured_tpot_ms:
            lo = mid
        else:
            hi = mid
        if abs(mid_ms - measured_tpot_ms) < abs(best_ms - measured_tpot_ms):
            best, best_ms = mid, mid_ms
    return MixedFit(best, measured_tpot_ms, best_ms, base_ms, steps)


def offline_tpot(result: Mapping[str, Any]) -> tuple[float, int, int]:
    """(median TPOT ms, steps, requests) of a `bench offline --result-json` file's contents."""
    try:
        return (
            float(result["latency_ms"]["tpot_all"]["p50"]),
            int(result["steps"]),
            int(result["num_requests"]),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(
            f"not a bench offline result (no TPOT P50, steps, requests): {e}"
        ) from None


def replay_offline(shaping) -> Callable[[Calibration], tuple[float, int]]:
    """`run_offline` for `fit_mixed_kv`: the workload `shaping` (an OfflineConfig, the flags the
    offline run had) with every request queued at once on the calibration's own engine."""
    from nori_jax.plan.planner import Planner, PlanSettings

    settings = PlanSettings(shaping=shaping, percentiles=(50.0,))

    def run(cal: Calibration) -> tuple[float, int]:
        outcome = Planner(cal, settings).run_at(math.inf)
        return outcome.run.metrics["median_tpot_ms"], int(outcome.summary["steps"])

    return run
