"""Lengths follow their lognormal parameters; arrivals are Poisson or gamma at the offered rate."""

from __future__ import annotations

import math

import numpy as np
import pytest

from nori_jax.bench.workload import LognormalLengths, WorkloadConfig


def _gaps(times: np.ndarray) -> np.ndarray:
    return np.diff(np.concatenate([[0.0], times]))


@pytest.mark.parametrize(("mu", "sigma"), [(6.2, 0.8), (5.5, 0.7)])
def test_lognormal_lengths_follow_mu_and_sigma(mu: float, sigma: float) -> None:
    lengths = LognormalLengths(mu, sigma).sample(20_000, np.random.default_rng(0))
    assert np.log(lengths).mean() == pytest.approx(mu, abs=0.02)
    assert np.log(lengths).std() == pytest.approx(sigma, abs=0.02)
    assert lengths.dtype == np.int64


def test_lognormal_lengths_are_clipped_and_validated() -> None:
    lengths = LognormalLengths(6.2, 0.8, 300, 700).sample(5000, np.random.default_rng(0))
    assert lengths.min() == 300 and lengths.max() == 700
    with pytest.raises(ValueError, match="min_len"):
        LognormalLengths(6.2, 0.8, 10, 5)
    with pytest.raises(ValueError, match="sigma"):
        LognormalLengths(6.2, -1.0, 1, 5)


def test_default_workload_is_the_perf_workload_and_a_seed_fixes_it() -> None:
    w = WorkloadConfig(num_prompts=2000)
    ins, outs = w.lengths(2000, w.streams()[0])
    assert np.log(ins).mean() == pytest.approx(6.2, abs=0.05)
    assert np.log(outs).mean() == pytest.approx(5.5, abs=0.05)
    assert w.lengths(2000, w.streams()[0]) == (ins, outs)
    assert WorkloadConfig(dataset="fixed", input_len=7, output_len=3).lengths(
        2, w.streams()[0]
    ) == (
        [7, 7],
        [3, 3],
    )


def test_poisson_gaps_have_the_rate_mean_and_unit_cv() -> None:
    rate = 50.0
    times = WorkloadConfig(request_rate=rate).arrival_times(20_000)
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
    gaps = _gaps(WorkloadConfig(seed=1, burstiness=burstiness).arrival_times(20_000, 10.0))
    assert gaps.mean() == pytest.approx(0.1, rel=1e-9)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_infinite_rate_infinite_burstiness_and_rescaling_by_rate() -> None:
    assert np.all(WorkloadConfig().arrival_times(7) == 0)
    even = WorkloadConfig(burstiness=math.inf).arrival_times(5, 2.0)
    np.testing.assert_allclose(even, [0.5, 1.0, 1.5, 2.0, 2.5])
    w = WorkloadConfig(seed=3)  # a sweep sends one gap pattern at every rate, only compressed
    np.testing.assert_allclose(w.arrival_times(100, 8.0), w.arrival_times(100, 1.0) / 8.0)


@pytest.mark.parametrize(
    ("field", "value"),
    [("num_prompts", 0), ("request_rate", 0.0), ("burstiness", 0.0), ("dataset", "sharegpt")],
)
def test_invalid_workloads_raise_naming_the_value(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field.split("_")[0]):
        WorkloadConfig(**{field: value})
    with pytest.raises(ValueError, match="dataset-path"):
        WorkloadConfig(dataset="jsonl")


def test_a_burstiness_too_small_for_a_schedule_is_refused_naming_it() -> None:
    """Gamma gaps of shape 1e-4 underflow to 0: their sum is 0 and the rescaled times NaN."""
    with pytest.raises(ValueError, match="burstiness 0.0001 is too small"):
        WorkloadConfig(burstiness=1e-4, num_prompts=10, request_rate=2.0)
    for burstiness in (1e-3, 1e-2):  # very bursty, but a schedule exists
        times = WorkloadConfig(burstiness=burstiness, num_prompts=10).arrival_times(10, 2.0)
        assert np.all(np.isfinite(times)) and np.all(np.diff(times) >= 0)
        assert times[-1] == pytest.approx(5.0)


def test_a_dataset_path_without_the_jsonl_dataset_is_refused() -> None:
    with pytest.raises(ValueError, match="--dataset-path is read only with --dataset jsonl"):
        WorkloadConfig(dataset="fixed", path="prompts.jsonl")
