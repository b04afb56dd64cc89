"""Arrival times of a run, fixed before the first request leaves the client.

Gaps are i.i.d. Gamma(shape=burstiness, scale=1/(rate*burstiness)): mean 1/rate and coefficient of
variation 1/sqrt(burstiness), so burstiness 1 is a Poisson process, below 1 burstier, above 1
smoother, inf evenly spaced. As `vllm bench serve` does, the times are then rescaled so the last
arrival falls exactly at num/rate: the offered rate of a finite run is then exactly `rate`
instead of off by the sampling noise of the gap sum (about 1/sqrt(num)).
"""

from __future__ import annotations

import math

import numpy as np


def arrival_times(num: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """[num] float64 seconds after the start of the run, non-decreasing."""
    if num < 1:
        raise ValueError(f"num must be >= 1, got {num=}")
    if not rate > 0 or not burstiness > 0:
        raise ValueError(f"rate and burstiness must be > 0, got {rate=} {burstiness=}")
    if math.isinf(rate):
        return np.zeros(num)
    if math.isinf(burstiness):
        gaps = np.full(num, 1.0 / rate)
    else:
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num)
    times = np.cumsum(gaps)
    return times * ((num / rate) / times[-1])
