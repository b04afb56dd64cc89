"""Queueing sanity of the simulated engine (Little's law, keeping up with the offered load) and
the bench's knee detector on simulated curves."""

from __future__ import annotations

import math

import numpy as np
import pytest
from plan_helpers import synthetic_calibration

from nori_jax.bench.offline import OfflineConfig
from nori_jax.bench.sweep import SweepConfig, find_knee, run_sweep
from nori_jax.bench.workload import LognormalLengths, WorkloadConfig
from nori_jax.plan.planner import Planner, PlanSettings
from nori_jax.plan.simulator import simulate
from nori_jax.plan.whatif import sim_engine
from nori_jax.plan.workload import at_rate, draw


def _planner(n: int) -> Planner:
    w = WorkloadConfig(dataset="fixed", num_prompts=n, input_len=96, output_len=24)
    return Planner(synthetic_calibration(), PlanSettings(OfflineConfig(w)))


def test_littles_law_holds_in_simulated_steady_state():
    cal = synthetic_calibration()
    engine, _ = sim_engine(cal)
    w = WorkloadConfig(
        dataset="lognormal",
        num_prompts=600,
        input_lengths=LognormalLengths(4.5, 0.8, 1, 600),  # median 90 tokens
        output_lengths=LognormalLengths(3.5, 0.7, 1, 300),  # median 33
        seed=5,
    )
    drawn = draw(OfflineConfig(w), engine.vocab_size, engine.scheduler.max_model_len)
    rate = 150.0
    requests = at_rate(drawn, w, rate)
    res = simulate(engine, cal.costs, requests, request_rate=rate)

    arrivals = np.array([r.arrival_s for r in requests])
    ends = np.array([t[-1] for t in res.token_times])
    lo, hi = arrivals[-1] * 0.25, arrivals[-1] * 0.75  # away from the empty start and the drain
    # L: requests inside the engine core (running + waiting, as its scheduler counts them),
    # averaged over time; each count holds from one engine iteration to the next.
    t = np.array(res.stats.times)
    n = np.array(res.stats.in_core[1:], dtype=float)
    spans = np.clip(t[1:], lo, hi) - np.clip(t[:-1], lo, hi)
    occupancy = float((n * spans).sum() / (hi - lo))
    # lambda W: arrival rate in the window times the mean time in the system of those requests.
    inside = (arrivals >= lo) & (arrivals < hi)
    arrival_rate = inside.sum() / (hi - lo)
    sojourn = float((ends - arrivals)[inside].mean())
    assert occupancy > 5  # a loaded system, not an empty one
    assert occupancy == pytest.approx(arrival_rate * sojourn, rel=0.05)
    # Below saturation the engine delivers what is offered.
    assert res.run.metrics["request_throughput"] == pytest.approx(rate, rel=0.05)


def test_knee_of_a_simulated_sweep_brackets_the_engines_capacity():
    planner = _planner(150)
    capacity = planner.run_at(math.inf).run.metrics["request_throughput"]  # all at once
    runs, knee, reason = run_sweep(
        SweepConfig(start_rate=capacity / 8), lambda r: planner.run_at(r).run
    )
    assert reason == "knee found" and knee is not None
    # The knee is the last rate before throughput stopped following the offer: the engine still
    # had capacity to spare at half of it, and none at the next rate.
    assert knee.rate / 2 < capacity < knee.next_rate
    below = [r for r in runs if r.request_rate < capacity / 2]
    assert len(below) >= 2
    for r in below:  # keeping up, with flat latency
        assert r.metrics["request_throughput"] == pytest.approx(r.request_rate, rel=0.1)


def test_no_knee_on_rates_below_capacity():
    planner = _planner(100)
    capacity = planner.run_at(math.inf).run.metrics["request_throughput"]
    rates = tuple(capacity * f for f in (0.1, 0.2, 0.3))
    runs = [planner.run_at(r).run for r in rates]
    assert find_knee(runs) is None
