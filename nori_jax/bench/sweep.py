"""Rate sweeps and their knee: the last offered rate the server still keeps up with.

Runs sorted by offered rate R_0 < R_1 < ...; T_i is the measured total tok/s and L_i the P99
latencies (TTFT and TPOT). For the step from R_i to R_{i+1}:

    efficiency e_i = (T_{i+1} / T_i - 1) / (R_{i+1} / R_i - 1)

is the share of the extra offered load that came out as extra throughput: about 1 while the
server keeps up, about 0 once it is saturated. The step "climbs" when the P99 TTFT or the P99
TPOT grows by at least `min_latency_rise`. The knee is R_i for the first i with e_i < min_gain
and a step that climbs. Both are needed: a short run at a high rate under-delivers throughput
(its length is dominated by the last requests' latency) while latency stays flat, and latency
rises a little under batching while throughput still scales.

A sweep is a given list of rates, or a ramp that doubles from `start_rate` until a knee appears,
more than half of a run's requests fail, or `max_steps` runs. The logic takes a `run_at(rate)`
function, so it is tested on synthetic curves without a server.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

from nori_jax.bench.run import RunResult


@dataclasses.dataclass(frozen=True)
class Knee:
    rate: float  # the knee: the last rate before throughput stopped rising
    next_rate: float  # the rate at which it stopped
    efficiency: float  # of the step rate -> next_rate
    ttft_rise: float  # relative P99 rise over that step
    tpot_rise: float


@dataclasses.dataclass(frozen=True)
class SweepConfig:
    rates: tuple[float, ...] | None = None  # None: the automatic doubling ramp
    start_rate: float = 1.0
    max_steps: int = 10
    min_gain: float = 0.5
    min_latency_rise: float = 0.2
    max_failed_fraction: float = 0.5  # a server failing most requests has nothing left to ramp

    def __post_init__(self) -> None:
        if self.rates is not None:
            if len(self.rates) < 2 or len(set(self.rates)) != len(self.rates):
                raise ValueError(f"a sweep needs two or more distinct rates, got {self.rates}")
            if any(not (r > 0 and math.isfinite(r)) for r in self.rates):
                raise ValueError(f"sweep rates must be finite and > 0, got {self.rates}")
        if not (self.start_rate > 0 and math.isfinite(self.start_rate)):
            raise ValueError(f"start_rate must be finite and > 0, got {self.start_rate}")
        if self.max_steps < 2:
            raise ValueError(f"max_steps must be >= 2, got {self.max_steps}")
        if not 0 < self.min_gain <= 1:
            raise ValueError(f"min_gain must be in (0, 1], got {self.min_gain}")
        if not self.min_latency_rise > 0:
            raise ValueError(f"min_latency_rise must be > 0, got {self.min_latency_rise}")


def find_knee(runs: Sequence[RunResult], cfg: SweepConfig = SweepConfig()) -> Knee | None:
    pts = sorted(runs, key=lambda r: r.request_rate)
    for a, b in zip(pts[:-1], pts[1:], strict=True):
        ma, mb = a.metrics, b.metrics
        ta, tb = ma["total_token_throughput"], mb["total_token_throughput"]
        if ta > 0:
            eff = (tb / ta - 1) / (b.request_rate / a.request_rate - 1)
        else:
            eff = 1.0 if tb > 0 else 0.0  # from nothing to something scales fully
        ttft_rise = _rise(ma["p99_ttft_ms"], mb["p99_ttft_ms"])
        tpot_rise = _rise(ma["p99_tpot_ms"], mb["p99_tpot_ms"])
        if eff < cfg.min_gain and max(ttft_rise, tpot_rise) >= cfg.min_latency_rise:
            return Knee(a.request_rate, b.request_rate, eff, ttft_rise, tpot_rise)
    return None


def _rise(a: float, b: float) -> float:
    return b / a - 1 if a > 0 else (math.inf if b > 0 else 0.0)


def run_sweep(
    cfg: SweepConfig, run_at: Callable[[float], RunResult]
) -> tuple[list[RunResult], Knee | None, str]:
    """(runs in rate order, the knee or None, why the sweep stopped)."""
    runs: list[RunResult] = []
    rates = sorted(cfg.rates) if cfg.rates is not None else None
    reason = "all rates run" if rates is not None else f"no knee after {cfg.max_steps} doublings"
    for step in range(len(rates) if rates is not None else cfg.max_steps):
        run = run_at(rates[step] if rates is not None else cfg.start_rate * 2**step)
        runs.append(run)
        n = run.metrics["completed"] + run.metrics["failed"]
        if run.interrupted:
            reason = "interrupted (Ctrl-C)"
            break
        if rates is None and find_knee(runs, cfg) is not None:
            reason = "knee found"
            break
        if rates is None and n and run.metrics["failed"] / n > cfg.max_failed_fraction:
            reason = f"more than {cfg.max_failed_fraction:.0%} of requests failed"
            break
    return runs, find_knee(runs, cfg), reason
