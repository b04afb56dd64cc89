"""Rate sweeps: a given list of rates, or an automatic ramp that doubles until the knee.

The sweep logic takes a `run_at(rate)` function, so the ramp and the stopping rules are tested
on synthetic curves without a server.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from nori_jax.bench.knee import Knee, KneeCriteria, SweepPoint, find_knee
from nori_jax.bench.runner import RunResult


@dataclasses.dataclass(frozen=True)
class SweepConfig:
    rates: tuple[float, ...] | None = None  # None: the automatic doubling ramp
    start_rate: float = 1.0
    max_steps: int = 10
    # A server failing most requests has no meaningful throughput left to ramp.
    max_failed_fraction: float = 0.5
    criteria: KneeCriteria = KneeCriteria()

    def __post_init__(self) -> None:
        if self.rates is not None:
            if len(self.rates) < 2:
                raise ValueError(f"a sweep needs at least two rates, got {self.rates=}")
            if any(not (r > 0 and math.isfinite(r)) for r in self.rates):
                raise ValueError(f"sweep rates must be finite and > 0, got {self.rates=}")
            if len(set(self.rates)) != len(self.rates):
                raise ValueError(f"sweep rates must be distinct, got {self.rates=}")
        if not (self.start_rate > 0 and math.isfinite(self.start_rate)):
            raise ValueError(f"start_rate must be finite and > 0, got {self.start_rate=}")
        if self.max_steps < 2:
            raise ValueError(f"max_steps must be >= 2, got {self.max_steps=}")

    @property
    def num_steps(self) -> int:
        return len(self.rates) if self.rates is not None else self.max_steps


@dataclasses.dataclass(frozen=True)
class SweepOutcome:
    runs: list[RunResult]
    knee: Knee | None
    stop_reason: str


def sweep_point(run: RunResult) -> SweepPoint:
    m = run.metrics
    return SweepPoint(run.request_rate, m.total_token_throughput, _p99(m.ttft), _p99(m.tpot))


def _p99(summary) -> float:
    return dict(summary.percentiles).get(99.0, summary.median)


def run_sweep(cfg: SweepConfig, run_at: Callable[[float], RunResult]) -> SweepOutcome:
    runs: list[RunResult] = []
    rates = sorted(cfg.rates) if cfg.rates is not None else None
    reason = "all rates run"
    for step in range(cfg.num_steps):
        rate = rates[step] if rates is not None else cfg.start_rate * 2**step
        run = run_at(rate)
        runs.append(run)
        n = run.metrics.completed + run.metrics.failed
        if rates is None:
            if find_knee([sweep_point(r) for r in runs], cfg.criteria) is not None:
                reason = "knee found"
                break
            if n and run.metrics.failed / n > cfg.max_failed_fraction:
                reason = f"more than {cfg.max_failed_fraction:.0%} of requests failed"
                break
    else:
        if rates is None:
            reason = f"no knee after {cfg.max_steps} doublings"
    return SweepOutcome(runs, find_knee([sweep_point(r) for r in runs], cfg.criteria), reason)
