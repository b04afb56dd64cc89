"""Arrival schedules: Poisson mean and coefficient of variation, gamma burstiness, edge cases."""

from __future__ import annotations

import math

import numpy as np
import pytest

from nori_jax.bench.arrivals import arrival_times


def _gaps(times: np.ndarray) -> np.ndarray:
    return np.diff(np.concatenate([[0.0], times]))


def test_poisson_gaps_have_the_rate_mean_and_unit_cv() -> None:
    rate = 50.0
    times = arrival_times(20_000, rate, 1.0, np.random.default_rng(0))
    gaps = _gaps(times)
    assert np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(1 / rate, rel=1e-9)  # rescaled: exactly N/rate in all
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.03)
    # a Poisson process: counts in fixed windows have variance equal to their mean
    counts = np.bincount(np.floor(times).astype(int))[:-1]
    assert counts.var() / counts.mean() == pytest.approx(1.0, abs=0.15)
    assert counts.mean() == pytest.approx(rate, rel=0.02)


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_burstiness_sets_the_cv(burstiness: float) -> None:
    gaps = _gaps(arrival_times(20_000, 10.0, burstiness, np.random.default_rng(1)))
    assert gaps.mean() == pytest.approx(0.1, rel=1e-9)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_infinite_rate_and_infinite_burstiness() -> None:
    assert np.all(arrival_times(7, math.inf, 1.0, np.random.default_rng(0)) == 0)
    even = arrival_times(5, 2.0, math.inf, np.random.default_rng(0))
    np.testing.assert_allclose(even, [0.5, 1.0, 1.5, 2.0, 2.5])


def test_seeded_pattern_is_rescaled_by_rate() -> None:
    """A sweep sends the same gap pattern at every rate, only compressed."""
    slow = arrival_times(100, 1.0, 1.0, np.random.default_rng([3, 2]))
    fast = arrival_times(100, 8.0, 1.0, np.random.default_rng([3, 2]))
    np.testing.assert_allclose(fast, slow / 8.0)


@pytest.mark.parametrize(("num", "rate", "burstiness"), [(0, 1.0, 1.0), (5, 0.0, 1.0), (5, 1, 0)])
def test_invalid_schedules_raise(num: int, rate: float, burstiness: float) -> None:
    with pytest.raises(ValueError):
        arrival_times(num, rate, burstiness, np.random.default_rng(0))
