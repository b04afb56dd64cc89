"""How many replicas serve a target rate within latency SLOs, and what a million tokens costs.

A replica meets the SLOs at rate r when the simulated run at r has no failed request and the
SLO percentile (P99 by default) of every named metric is within its bound. The largest such r
is found by doubling from `start_rate` until the SLOs break, then bisecting (geometric means)
until the bracket is within `rel_tol`; latency is assumed to grow with the rate, which holds for
one queue and is what the doubling checks once more at every step. The load is split evenly
over identical replicas (a random split of a Poisson stream is again Poisson), so
`replicas = ceil(target / r)` and each replica then runs at target / replicas <= r.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping

from nori_jax.bench.metrics import percentile_word
from nori_jax.bench.run import RunResult

SLO_METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclasses.dataclass(frozen=True)
class Slo:
    limits_ms: Mapping[str, float]
    percentile: float = 99.0

    def __post_init__(self) -> None:
        if not self.limits_ms:
            raise ValueError("an SLO needs at least one NAME:MS bound, e.g. ttft:500")
        for name, ms in self.limits_ms.items():
            if name not in SLO_METRICS or not (ms > 0 and math.isfinite(ms)):
                raise ValueError(
                    f"SLO bounds are NAME:MS with NAME in {SLO_METRICS} and MS > 0, got {name}:{ms}"
                )
        if not 0 < self.percentile < 100:
            raise ValueError(f"SLO percentile must be in (0, 100), got {self.percentile}")

    def key(self, name: str) -> str:
        return f"p{percentile_word(self.percentile)}_{name}_ms"

    def violations(self, metrics: Mapping[str, float]) -> list[str]:
        p = percentile_word(self.percentile)
        out = [
            f"P{p} {name.upper()} {metrics[self.key(name)]:.1f} > {ms:g} ms"
            for name, ms in self.limits_ms.items()
            if metrics[self.key(name)] > ms
        ]
        if metrics["failed"]:
            out.append(f"{metrics['failed']} failed requests")
        return out


@dataclasses.dataclass(frozen=True)
class MaxRate:
    rate: float  # the largest rate found within the SLOs
    run: RunResult  # the run at that rate
    broken_at: float  # the smallest rate found beyond them
    runs: int  # simulated runs the search took


def max_rate_within(
    slo: Slo,
    run_at: Callable[[float], RunResult],
    start_rate: float = 1.0,
    rel_tol: float = 0.03,
    max_runs: int = 40,
) -> MaxRate:
    if not (start_rate > 0 and math.isfinite(start_rate)) or not 0 < rel_tol < 1:
        raise ValueError(f"need start_rate > 0 and 0 < rel_tol < 1, got {start_rate}, {rel_tol}")
    runs = 0

    def ok(rate: float) -> tuple[bool, RunResult]:
        nonlocal runs
        runs += 1
        run = run_at(rate)
        return not slo.violations(run.metrics), run

    rate = start_rate
    good, run = ok(rate)
    lo_run: RunResult | None = run if good else None
    lo, hi = (rate, math.inf) if good else (0.0, rate)
    while runs < max_runs and (math.isinf(hi) or lo == 0.0):
        rate = rate * 2 if good else rate / 2
        good, run = ok(rate)
        if good:
            lo, lo_run = rate, run
        else:
            hi = rate
        if lo == 0.0 and rate < start_rate * 2**-12:
            why = "; ".join(slo.violations(run.metrics))
            raise ValueError(
                f"the SLOs are out of reach: even at {rate:.3g} req/s one replica has {why}"
            )
    if lo == 0.0:
        raise ValueError(f"no rate within the SLOs found in {runs} runs (down to {rate:.3g} req/s)")
    while runs < max_runs and not math.isinf(hi) and hi / lo > 1 + rel_tol:
        mid = math.sqrt(lo * hi)
        good, run = ok(mid)
        if good:
            lo, lo_run = mid, run
        else:
            hi = mid
    assert lo_run is not None
    return MaxRate(lo, lo_run, hi, runs)


@dataclasses.dataclass(frozen=True)
class Sizing:
    replicas: int
    gpus: int
    rate_per_replica: float
    cost_per_hour: float | None
    cost_per_million_tokens: float | None  # input + output tokens
    cost_per_million_output_tokens: float | None


def size(
    target_rate: float,
    max_rate: float,
    gpus_per_replica: int,
    tokens_per_request: tuple[float, float],
    gpu_hour_price: float | None,
) -> Sizing:
    if not (target_rate > 0 and math.isfinite(target_rate)):
        raise ValueError(f"target rate must be finite and > 0, got {target_rate}")
    if gpu_hour_price is not None and not gpu_hour_price >= 0:
        raise ValueError(f"GPU-hour price must be >= 0, got {gpu_hour_price}")
    replicas = math.ceil(target_rate / max_rate * (1 - 1e-9))
    gpus = replicas * gpus_per_replica
    if gpu_hour_price is None:
        return Sizing(replicas, gpus, target_rate / replicas, None, None, None)
    per_hour = gpus * gpu_hour_price
    total, output = (target_rate * 3600 * t for t in tokens_per_request)
    return Sizing(
        replicas, gpus, target_rate / replicas, per_hour, per_hour / total * 1e6,
        per_hour / output * 1e6,
    )  # fmt: skip
