"""Rate sweeps and their knee: the last offered rate the server still keeps up with.

Runs sorted by offered rate R_0 < R_1 < ...; T_i is the measured total tok/s and L_i the P99
latencies (TTFT and TPOT). For the step from R_i to R_{i+1}:

    efficiency e_i = (T_{i+1} / T_i - 1) / (R_{i+1} / R_i - 1)

is the share of the extra offered load that came out as extra throughput: about 1 while the
server keeps up, about 0 once it is saturated. The step "climbs" when the P99 TTFT or the P99
TPOT grows by at least `min_latency_rise`. Both are needed: a short run at a high rate
under-delivers throughput (its length is dominated by the last requests' latency) while latency
stays flat, and latency rises a little under batching while throughput still scales.

A run "falls behind" when its queue grows over the run: the median TTFT of its last fifth of
requests is at least `max_ttft_growth` times its first fifth's and `min_ttft_growth_ms` more
(metrics: ttft_growth, ttft_growth_ms), or more than `max_failed_for_knee` of its requests
failed (a server that refuses load is not absorbing it). The efficiency test alone misses a
capacity between two rates: with capacity 7 req/s, 4 -> 8 still gains 0.75 of the extra load,
and 8 -> 16 none, so 8 would pass as the knee although the server could not hold it.

The knee is R_i for the first step that falls behind at R_{i+1} (R_i not) or has e_i < min_gain
and climbs. The server's capacity lies between R_i and R_{i+1}; a sweep that falls behind at its
first rate has no knee (the capacity is below it).

A sweep is a given list of rates, or a ramp that doubles from `start_rate` until a knee appears,
the first rate falls behind (FIRST_RATE_BEHIND: the capacity is below it, and doubling only
overloads the server more), more than half of a run's requests fail, or `max_steps` runs. The
logic takes a `run_at(rate)` function, so it is tested on synthetic curves without a server.
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
    max_ttft_growth: float = 2.0  # a run whose TTFT grew this much over it falls behind ...
    min_ttft_growth_ms: float = 100.0  # ... by at least this much (not a few ms of jitter)
    max_failed_for_knee: float = 0.01  # a run failing more than this share falls behind

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


def falls_behind(run: RunResult, cfg: SweepConfig = SweepConfig()) -> bool:
    """Did the server's queue grow over the run, or did it refuse the load (module docstring)?"""
    m = run.metrics
    n = m["completed"] + m["failed"]
    if n and m["failed"] / n > cfg.max_failed_for_knee:
        return True
    # (runs recorded before these keys: no evidence either way)
    growth, rise_ms = m.get("ttft_growth", 1.0), m.get("ttft_growth_ms", 0.0)
    return growth >= cfg.max_ttft_growth and rise_ms >= cfg.min_ttft_growth_ms


def find_knee(runs: Sequence[RunResult], cfg: SweepConfig = SweepConfig()) -> Knee | None:
    pts = sorted(runs, key=lambda r: r.request_rate)
    if pts and falls_behind(pts[0], cfg):
        return None  # the capacity is below the first rate
    for a, b in zip(pts[:-1], pts[1:], strict=True):
        ma, mb = a.metrics, b.metrics
        ta, tb = ma["total_token_throughput"], mb["total_token_throughput"]
        if ta > 0:
            eff = (tb / ta - 1) / (b.request_rate / a.request_rate - 1)
        else:
            eff = 1.0 if tb > 0 else 0.0  # from nothing to something scales fully
        ttft_rise = _rise(ma["p99_ttft_ms"], mb["p99_ttft_ms"])
        tpot_rise = _rise(ma["p99_tpot_ms"], mb["p99_tpot_ms"])
        climbs = max(ttft_rise, tpot_rise) >= cfg.min_latency_rise
        if falls_behind(b, cfg) or (eff < cfg.min_gain and climbs):
            return Knee(a.request_rate, b.request_rate, eff, ttft_rise, tpot_rise)
    return None


def _rise(a: float, b: float) -> float:
    return b / a - 1 if a > 0 else (math.inf if b > 0 else 0.0)


# The stop reason of a sweep whose first (lowest) rate already falls behind: no knee, because
# the capacity is below every tested rate (not above them, as after a sweep that never found one)
FIRST_RATE_BEHIND = "the first rate already falls behind"


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
        if rates is None and n and run.metrics["failed"] / n > cfg.max_failed_fraction:
            reason = f"more than {cfg.max_failed_fraction:.0%} of requests failed"
            break
        if step == 0 and falls_behind(run, cfg):
            reason = FIRST_RATE_BEHIND  # doubling on would only overload the server more
            if rates is None:
                break
        if rates is None and find_knee(runs, cfg) is not None:
            reason = "knee found"
            break
    return runs, find_knee(runs, cfg), reason


def knee_line(runs: Sequence[RunResult], knee: Knee | None, stop_reason: str) -> str:
    """The printed verdict of a sweep."""
    if knee is not None:
        return (
            f"Knee: {knee.rate:g} req/s (throughput efficiency {knee.efficiency:.2f} and "
            f"P99 TTFT {_percent(knee.ttft_rise)} / TPOT {_percent(knee.tpot_rise)} at "
            f"{knee.next_rate:g} req/s)"
        )
    if stop_reason == FIRST_RATE_BEHIND:
        first = min(r.request_rate for r in runs)
        return (
            f"Knee: none: the first rate already falls behind: capacity is below {first:g} "
            "req/s; retry with a lower --sweep-start-rate (or lower --sweep rates)"
        )
    return f"Knee: not found within the tested rates ({stop_reason})"


def knee_dict(knee: Knee | None) -> dict[str, float | None] | None:
    """The knee for JSON: an infinite rise (from a P99 of 0) is None, since JSON has no inf."""
    if knee is None:
        return None
    return {k: v if math.isfinite(v) else None for k, v in dataclasses.asdict(knee).items()}


def _percent(rise: float) -> str:
    return f"{rise:+.0%}" if math.isfinite(rise) else "up from 0"
