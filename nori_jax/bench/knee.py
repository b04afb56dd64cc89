"""The knee of a rate sweep: the last offered rate the server still keeps up with.

Points sorted by offered rate R_0 < R_1 < ...; T_i is the measured throughput (total tok/s) and
L_i the P99 latencies (TTFT and TPOT). For the step from R_i to R_{i+1}:

    efficiency e_i = (T_{i+1} / T_i - 1) / (R_{i+1} / R_i - 1)

is the share of the extra offered load that came out as extra throughput: about 1 while the
server keeps up, about 0 once it is saturated. The step "climbs" when the P99 TTFT or the P99
TPOT grows by at least `min_latency_rise` (relative). The knee is R_i for the first i with

    e_i < min_gain  and  the step climbs.

Requiring both makes the definition robust to each one's false alarm: a short run at a high
rate can under-deliver throughput (its length is dominated by the last requests' latency) while
latency stays flat, and latency can rise a little (batching) while throughput still scales.
No such step: no knee within the tested rates (a monotone curve, or a sweep that stopped short).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

DEFAULT_MIN_GAIN = 0.5
DEFAULT_MIN_LATENCY_RISE = 0.2


@dataclasses.dataclass(frozen=True)
class SweepPoint:
    rate: float  # offered, req/s
    throughput: float  # measured total tok/s
    p99_ttft_ms: float
    p99_tpot_ms: float


@dataclasses.dataclass(frozen=True)
class Knee:
    rate: float  # the knee: the last rate before throughput stopped rising
    next_rate: float  # the rate at which it stopped
    efficiency: float  # of the step rate -> next_rate
    ttft_rise: float  # relative P99 rise over that step
    tpot_rise: float


@dataclasses.dataclass(frozen=True)
class KneeCriteria:
    min_gain: float = DEFAULT_MIN_GAIN
    min_latency_rise: float = DEFAULT_MIN_LATENCY_RISE

    def __post_init__(self) -> None:
        if not 0 < self.min_gain <= 1:
            raise ValueError(f"min_gain must be in (0, 1], got {self.min_gain=}")
        if not self.min_latency_rise > 0:
            raise ValueError(f"min_latency_rise must be > 0, got {self.min_latency_rise=}")


def step_efficiency(a: SweepPoint, b: SweepPoint) -> float:
    if a.throughput <= 0:
        return 1.0 if b.throughput > 0 else 0.0  # from nothing to something scales fully
    return (b.throughput / a.throughput - 1) / (b.rate / a.rate - 1)


def _rise(a: float, b: float) -> float:
    return b / a - 1 if a > 0 else (float("inf") if b > 0 else 0.0)


def find_knee(points: Sequence[SweepPoint], criteria: KneeCriteria = KneeCriteria()) -> Knee | None:
    pts = sorted(points, key=lambda p: p.rate)
    for a, b in zip(pts[:-1], pts[1:], strict=True):
        if b.rate == a.rate:
            raise ValueError(f"duplicate rate in sweep: {a.rate}")
        eff = step_efficiency(a, b)
        ttft_rise, tpot_rise = (
            _rise(a.p99_ttft_ms, b.p99_ttft_ms),
            _rise(a.p99_tpot_ms, b.p99_tpot_ms),
        )
        climbs = max(ttft_rise, tpot_rise) >= criteria.min_latency_rise
        if eff < criteria.min_gain and climbs:
            return Knee(a.rate, b.rate, eff, ttft_rise, tpot_rise)
    return None
