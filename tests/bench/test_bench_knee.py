"""The knee on synthetic curves and the automatic ramp (the plot: test_bench_report.py)."""

from __future__ import annotations

import pytest

from nori_jax.bench.run import RunResult
from nori_jax.bench.sweep import SweepConfig, find_knee, run_sweep

CAPACITY = 10.0  # req/s the synthetic server sustains
TOKENS_PER_REQUEST = 1000.0


def _run(rate: float, tok_s: float, ttft_ms: float, tpot_ms: float, failed: int = 0) -> RunResult:
    metrics = {
        "completed": 100 - failed,
        "failed": failed,
        "total_token_throughput": tok_s,
        "p99_ttft_ms": ttft_ms,
        "p99_tpot_ms": tpot_ms,
    }
    return RunResult(rate, metrics, [], [], {}, [])


def _server(rate: float, failed: int = 0) -> RunResult:
    """Throughput follows the offered rate up to capacity; past it, queues grow the P99s."""
    overload = max(rate / CAPACITY, 1.0)
    tok_s = min(rate, CAPACITY) * TOKENS_PER_REQUEST
    return _run(rate, tok_s, 80.0 * overload**3, 20.0 * overload, failed)


def test_knee_is_the_last_rate_before_saturation_in_any_order() -> None:
    knee = find_knee([_server(r) for r in (32, 4, 1, 16, 8, 2)])
    assert knee is not None and knee.rate == 8 and knee.next_rate == 16
    assert knee.efficiency == pytest.approx((10 / 8 - 1) / (16 / 8 - 1))
    assert knee.ttft_rise > 0.2


def test_no_knee_on_a_monotone_curve() -> None:
    assert find_knee([_run(r, 1000.0 * r, 80.0, 20.0) for r in (1, 2, 4, 8, 16)]) is None


def test_flat_throughput_without_latency_climb_is_not_a_knee() -> None:
    """A short run at a high rate under-delivers throughput while latency stays flat."""
    assert find_knee([_run(1, 1000.0, 80.0, 20.0), _run(2, 1100.0, 82.0, 20.5)]) is None


def test_latency_climb_with_scaling_throughput_is_not_a_knee() -> None:
    assert find_knee([_run(1, 1000.0, 80.0, 20.0), _run(2, 1990.0, 160.0, 30.0)]) is None


def _fluid(rate: float, capacity: float, n: int = 1000) -> RunResult:
    """A fluid queue: n requests offered at `rate` to a server of `capacity` req/s (100 tokens
    each, 1 s of service); past capacity the backlog, and with it TTFT, grows over the run."""
    duration = max(n / rate, n / capacity) + 1.0
    backlog = n * (1 - capacity / rate) if rate > capacity else 0.0
    first_ms, last_ms = 100.0, 100.0 + 1e3 * backlog / capacity  # first and last fifth's TTFT
    metrics = {
        "completed": n,
        "failed": 0,
        "total_token_throughput": n * 100 / duration,
        "p99_ttft_ms": last_ms,
        "p99_tpot_ms": 20.0,
        "ttft_growth": last_ms / first_ms,
        "ttft_growth_ms": last_ms - first_ms,
    }
    return RunResult(rate, metrics, [], [], {}, [])


@pytest.mark.parametrize("capacity", [5.0, 6.0, 7.0, 7.9, 12.0])
def test_the_knee_is_below_the_capacity_wherever_it_falls_between_rates(capacity) -> None:
    """With capacity 7, 4 -> 8 still gains 0.75 of the extra load and only 8 -> 16 gains none:
    the efficiency test alone made 8 the knee, a rate the server could not hold (its queue grew
    the whole run). The run that falls behind marks it."""
    knee = find_knee([_fluid(r, capacity) for r in (1, 2, 4, 8, 16, 32)])
    assert knee is not None and knee.rate < capacity <= knee.next_rate


def test_a_server_behind_at_the_first_rate_has_no_knee() -> None:
    assert find_knee([_fluid(r, 0.5) for r in (1, 2, 4)]) is None


def test_failing_requests_is_falling_behind() -> None:
    """A server that refuses a share of the load (429, 503) keeps its survivors' P99 flat."""
    runs = [_run(1, 1000.0, 80.0, 20.0), _run(2, 2000.0, 80.0, 20.0, failed=5)]
    knee = find_knee(runs)
    assert knee is not None and knee.rate == 1


def test_auto_ramp_doubles_until_the_knee() -> None:
    rates: list[float] = []

    def run_at(rate: float) -> RunResult:
        rates.append(rate)
        return _server(rate)

    runs, knee, reason = run_sweep(SweepConfig(start_rate=1.0, max_steps=10), run_at)
    assert rates == [1, 2, 4, 8, 16]  # stops at the first step past capacity
    assert knee is not None and knee.rate == 8 and reason == "knee found"


def test_auto_ramp_stops_when_requests_fail_or_on_ctrl_c() -> None:
    runs, _, reason = run_sweep(SweepConfig(), lambda r: _server(r, failed=60 if r > 2 else 0))
    assert [r.request_rate for r in runs] == [1, 2, 4] and "failed" in reason
    interrupted = lambda r: RunResult(r, _server(r).metrics, [], [], {}, [], r >= 2)  # noqa: E731
    runs, _, reason = run_sweep(SweepConfig(rates=(1.0, 2.0, 4.0)), interrupted)
    assert [r.request_rate for r in runs] == [1, 2] and reason == "interrupted (Ctrl-C)"


def test_explicit_sweep_runs_every_rate_in_order() -> None:
    runs, knee, reason = run_sweep(SweepConfig(rates=(16.0, 1.0, 8.0)), _server)
    assert [r.request_rate for r in runs] == [1, 8, 16] and reason == "all rates run"
    assert knee is not None and knee.rate == 8


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"rates": (1.0,)}, "rates"),
        ({"rates": (1.0, 1.0)}, "rates"),
        ({"rates": (1.0, float("inf"))}, "rates"),
        ({"rates": (0.0, 1.0)}, "rates"),
        ({"min_gain": 0.0}, "min_gain"),
        ({"max_steps": 1}, "max_steps"),
    ],
)
def test_bad_sweeps_raise(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SweepConfig(**kw)


def test_a_ramp_behind_at_its_first_rate_stops_there_and_says_so() -> None:
    """Capacity below the first rate is not 'no knee within the rates' (capacity above them)."""
    from nori_jax.bench.sweep import FIRST_RATE_BEHIND, knee_line

    rates: list[float] = []

    def run_at(rate: float) -> RunResult:
        rates.append(rate)
        return _fluid(rate, 0.5)

    runs, knee, reason = run_sweep(SweepConfig(start_rate=1.0), run_at)
    assert rates == [1] and knee is None and reason == FIRST_RATE_BEHIND
    line = knee_line(runs, knee, reason)
    assert "the first rate already falls behind: capacity is below 1 req/s" in line
    assert "--sweep-start-rate" in line and "not found within" not in line
    runs, _, reason = run_sweep(SweepConfig(rates=(2.0, 4.0)), lambda r: _fluid(r, 0.5))
    assert len(runs) == 2 and reason == FIRST_RATE_BEHIND
    _, _, reason = run_sweep(SweepConfig(rates=(1.0, 2.0)), lambda r: _server(r))
    assert reason == "all rates run"


def test_an_infinite_latency_rise_is_written_as_null(tmp_path) -> None:
    """A P99 TPOT of 0 at the lower rate (every request in one chunk) rises infinitely."""
    import json

    from nori_jax.bench import report
    from nori_jax.bench.sweep import knee_dict, knee_line

    knee = find_knee([_run(4, 1000.0, 100.0, 0.0), _run(8, 1050.0, 100.0, 20.0)])
    assert knee is not None and knee.tpot_rise == float("inf")
    report.write_json(tmp_path / "k.json", {"knee": knee_dict(knee)})  # raises nothing
    assert json.loads((tmp_path / "k.json").read_text())["knee"]["tpot_rise"] is None
    assert "TPOT up from 0" in knee_line([], knee, "knee found")
