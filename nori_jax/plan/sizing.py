"""How many replicas serve a target rate within latency SLOs, and what a million tokens costs.

A replica's capacity is the largest rate that is both
  - at or below its knee, by the bench's rule (`nori_jax.bench.sweep.find_knee`: throughput
    gains less than half of the extra offered load while a P99 latency rises 20%), found on a
    doubling ramp of simulated runs, then narrowed by bisection with the same rule applied to
    steps of 10% (the latency threshold scaled to the step), to within `rel_tol`; past the knee
    throughput no longer follows the offer and the queue grows, so a finite run's latencies
    say little there;
  - within the SLOs: no failed request, and the SLO percentile (P99 by default) of every named
    metric within its bound, found by bisection below the knee when the knee itself misses them.
Latency is assumed to grow with the rate (it does for one queue). The load is split evenly over
identical replicas (a random split of a Poisson stream is again Poisson), so
`replicas = ceil(target / capacity)` and each replica then runs at target / replicas.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping

from nori_jax.bench.metrics import percentile_word
from nori_jax.bench.run import RunResult
from nori_jax.bench.sweep import Knee, SweepConfig, find_knee, run_sweep

SLO_METRICS = ("ttft", "tpot", "itl", "e2el")
KNEE_STEP = 0.1  # relative rate step of the knee's narrowing


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
class Capacity:
    rate: float  # the largest rate found below the knee and within the SLOs
    run: RunResult  # the run at that rate
    limited_by: str  # "knee", "slo", or "ramp" (no knee on the ramp: `rate` is a lower bound)
    knee: Knee | None  # the ramp's knee (None: no knee within the ramp)
    broken_at: float  # the smallest rate found past the knee or beyond the SLOs
    runs: int  # simulated runs the search took


def capacity(
    slo: Slo,
    run_at: Callable[[float], RunResult],
    sweep: SweepConfig | None = None,
    rel_tol: float = 0.05,
) -> Capacity:
    """The capacity of one replica; `sweep` sets the ramp's start and the knee's rule."""
    if not 0 < rel_tol < 1:
        raise ValueError(f"rel_tol must be in (0, 1), got {rel_tol}")
    sweep = dataclasses.replace(sweep or SweepConfig(), rates=None)
    n = 0
    for _ in range(4):
        runs, knee, _ = run_sweep(sweep, run_at)
        n += len(runs)
        if knee is None or knee.rate > runs[0].request_rate:
            break
        # The ramp began at or past the knee, so its first rate says nothing: start lower.
        sweep = dataclasses.replace(sweep, start_rate=sweep.start_rate / 16)
    if knee is None:  # never saturated on the ramp: its last rate is as far as it is known
        lo, hi = runs[-1], math.inf
    else:
        # Narrow the ramp's 2x bracket, knee.rate / 2 .. knee.next_rate, with the same rule on
        # a step of KNEE_STEP instead of a doubling (the latency threshold scaled to the step).
        cache = {r.request_rate: r for r in runs}

        def at(rate: float) -> RunResult:
            nonlocal n
            if rate not in cache:
                cache[rate], n = run_at(rate), n + 1
            return cache[rate]

        local = _local_rule(sweep)
        scales = lambda m: find_knee([at(m), at(m * (1 + KNEE_STEP))], local) is None  # noqa: E731
        ok, past = knee.rate / 2, knee.next_rate
        while past / ok > 1 + rel_tol:
            mid = math.sqrt(ok * past)
            ok, past = (mid, past) if scales(mid) else (ok, mid)
        lo, hi = at(ok), past
    if not slo.violations(lo.metrics):
        if knee is None:
            # No knee within the ramp: the replica served at least what its last run achieved
            # (not what it was offered: a short run offered 1e5 req/s that served 500 was
            # credited 1e5, and a ramp cut short sized for its low last rate as if a knee).
            served = min(lo.request_rate, lo.metrics.get("request_throughput", lo.request_rate))
            return Capacity(served, lo, "ramp", None, hi, n)
        return Capacity(lo.request_rate, lo, "knee", knee, hi, n)
    # The knee misses the SLOs: bisect below it, starting from what the ramp already ran.
    tried = [r for r in runs if r.request_rate < lo.request_rate]
    good = max((r for r in tried if not slo.violations(r.metrics)), key=_rate, default=None)
    bad, worst = lo.request_rate, lo
    while good is None:  # below the ramp's start: halve until the SLOs hold
        rate = bad / 2
        if rate < sweep.start_rate * 2**-12:
            why = "; ".join(slo.violations(worst.metrics))
            raise ValueError(
                f"the SLOs are out of reach: even at {bad:.3g} req/s one replica has {why}"
            )
        run = run_at(rate)
        n += 1
        if slo.violations(run.metrics):
            bad, worst = rate, run
        else:
            good = run
    bad = min(
        [bad] + [_rate(r) for r in tried if _rate(good) < _rate(r) and slo.violations(r.metrics)]
    )
    while bad / good.request_rate > 1 + rel_tol:
        run = run_at(math.sqrt(good.request_rate * bad))
        n += 1
        if slo.violations(run.metrics):
            bad = run.request_rate
        else:
            good = run
    return Capacity(good.request_rate, good, "slo", knee, bad, n)


def _local_rule(sweep: SweepConfig) -> SweepConfig:
    """The knee's rule for a step of KNEE_STEP: the same throughput share, and the P99 rise
    that compounds to the doubling's `min_latency_rise` over a doubling."""
    exponent = math.log(1 + sweep.min_latency_rise) / math.log(2)
    return dataclasses.replace(sweep, min_latency_rise=(1 + KNEE_STEP) ** exponent - 1)


def _rate(run: RunResult) -> float:
    return run.request_rate


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
    if gpu_hour_price is not None and not (gpu_hour_price >= 0 and math.isfinite(gpu_hour_price)):
        raise ValueError(f"GPU-hour price must be finite and >= 0, got {gpu_hour_price}")
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
