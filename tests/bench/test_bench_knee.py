"""The knee on synthetic curves and the automatic ramp (the plot: test_bench_report.py)."""

from __future__ import annotations

import pytest

from nori_jax.bench.health import ClientHealth
from nori_jax.bench.knee import KneeCriteria, SweepPoint, find_knee
from nori_jax.bench.metrics import BenchmarkMetrics, Summary
from nori_jax.bench.runner import RunResult
from nori_jax.bench.sweep import SweepConfig, run_sweep

CAPACITY = 10.0  # req/s the synthetic server sustains
TOKENS_PER_REQUEST = 1000.0


def _server_curve(rate: float) -> SweepPoint:
    """Throughput follows the offered rate up to capacity; past it, queues grow the P99s."""
    served = min(rate, CAPACITY)
    overload = max(rate / CAPACITY, 1.0)
    return SweepPoint(rate, served * TOKENS_PER_REQUEST, 80.0 * overload**3, 20.0 * overload)


def test_knee_is_the_last_rate_before_saturation() -> None:
    points = [_server_curve(r) for r in (1, 2, 4, 8, 16, 32)]
    knee = find_knee(points)
    assert knee is not None and knee.rate == 8 and knee.next_rate == 16
    assert knee.efficiency == pytest.approx((10 / 8 - 1) / (16 / 8 - 1))
    assert knee.ttft_rise > 0.2


def test_knee_ignores_point_order() -> None:
    points = [_server_curve(r) for r in (32, 4, 1, 16, 8, 2)]
    assert find_knee(points).rate == 8  # type: ignore[union-attr]


def test_no_knee_on_a_monotone_curve() -> None:
    points = [SweepPoint(r, 1000.0 * r, 80.0, 20.0) for r in (1, 2, 4, 8, 16)]
    assert find_knee(points) is None


def test_flat_throughput_without_latency_climb_is_not_a_knee() -> None:
    """A short run at a high rate under-delivers throughput while latency stays flat."""
    points = [SweepPoint(1, 1000.0, 80.0, 20.0), SweepPoint(2, 1100.0, 82.0, 20.5)]
    assert find_knee(points) is None


def test_latency_climb_with_scaling_throughput_is_not_a_knee() -> None:
    points = [SweepPoint(1, 1000.0, 80.0, 20.0), SweepPoint(2, 1990.0, 160.0, 30.0)]
    assert find_knee(points) is None


def test_knee_criteria_are_validated() -> None:
    with pytest.raises(ValueError, match="min_gain"):
        KneeCriteria(min_gain=0.0)
    with pytest.raises(ValueError, match="duplicate rate"):
        find_knee([SweepPoint(1, 1, 1, 1), SweepPoint(1, 2, 2, 2)])


def _summary(value_ms: float, p99_ms: float) -> Summary:
    return Summary(value_ms, value_ms, 0.0, ((99.0, p99_ms),))


def _run(rate: float, failed: int = 0) -> RunResult:
    pt = _server_curve(rate)
    metrics = BenchmarkMetrics(
        completed=100 - failed,
        failed=failed,
        total_input=0,
        total_output=0,
        duration_s=1.0,
        request_throughput=pt.throughput / TOKENS_PER_REQUEST,
        request_goodput=None,
        output_throughput=pt.throughput / 3,
        total_token_throughput=pt.throughput,
        max_output_tokens_per_s=0.0,
        max_concurrent_requests=0,
        ttft=_summary(pt.p99_ttft_ms / 2, pt.p99_ttft_ms),
        tpot=_summary(pt.p99_tpot_ms / 2, pt.p99_tpot_ms),
        itl=_summary(1.0, 1.0),
        e2el=_summary(1.0, 1.0),
        output_lens=(),
    )
    health = ClientHealth(1, 0.0, 0.0, 0.0, 0.0, 0.0)
    return RunResult(rate, metrics, [], [], health, [])


def test_auto_ramp_doubles_until_the_knee() -> None:
    rates: list[float] = []

    def run_at(rate: float) -> RunResult:
        rates.append(rate)
        return _run(rate)

    outcome = run_sweep(SweepConfig(start_rate=1.0, max_steps=10), run_at)
    assert rates == [1, 2, 4, 8, 16]  # stops at the first step past capacity
    assert outcome.knee is not None and outcome.knee.rate == 8
    assert outcome.stop_reason == "knee found"


def test_auto_ramp_stops_when_requests_fail() -> None:
    outcome = run_sweep(SweepConfig(start_rate=1.0), lambda r: _run(r, failed=60 if r > 2 else 0))
    assert [r.request_rate for r in outcome.runs] == [1, 2, 4]
    assert "failed" in outcome.stop_reason


def test_explicit_sweep_runs_every_rate_in_order() -> None:
    outcome = run_sweep(SweepConfig(rates=(16.0, 1.0, 8.0)), _run)
    assert [r.request_rate for r in outcome.runs] == [1, 8, 16]
    assert outcome.knee is not None and outcome.knee.rate == 8


@pytest.mark.parametrize("rates", [(1.0,), (1.0, 1.0), (1.0, float("inf")), (0.0, 1.0)])
def test_bad_sweep_rates_raise(rates: tuple[float, ...]) -> None:
    with pytest.raises(ValueError, match="rate"):
        SweepConfig(rates=rates)
