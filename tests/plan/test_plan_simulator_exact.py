"""The simulator makes the scheduler decisions of a fake runner's real run, step for step.

Two references, both running the real scheduler and plan builder over tests/core's FakeDevice
(which computes every token from the sequence and checks placeholder resolution):
  - `run_to_completion` (every request queued at once, no clock), against the simulator at an
    infinite rate;
  - the engine-core loop with arrivals over time, the fake device taking a step-time function's
    seconds in virtual time, against the simulator given the same function as its device model.
The workloads force chunked prefill, prefix-cache hits and preemptions, and the test checks that
they happened.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from fake_runner import FakeDevice, make_request, make_scheduler, run_to_completion
from plan_helpers import DEVICE

from nori_jax.core.engine_core import EngineCore, EngineCoreRequest
from nori_jax.plan.features import step_features
from nori_jax.plan.simulator import SimEngine, SimRequest, simulate
from nori_jax.plan.step_model import HOST_TERMS, LinearModel, StepCosts
from nori_jax.sampling_params import SamplingParams

CONFIG = dict(max_model_len=256, page_size=16, max_num_seqs=8, max_num_batched_tokens=64)
NUM_PAGES = 40  # tight: preemptions happen
HOST_S = 2e-4  # the host's cost per launched step, in both runs


def _workload(n: int, seed: int) -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, 900, 48).tolist()  # three full pages every other prompt shares
    out = []
    for i in range(n):
        own = rng.integers(3, 900, int(rng.integers(1, 150))).tolist()
        out.append(((shared if i % 2 else []) + own, int(rng.integers(1, 40))))
    return out


def _sim_engine(async_scheduling: bool, **config) -> SimEngine:
    s = make_scheduler(NUM_PAGES, **(CONFIG | config))
    return SimEngine(s.config, NUM_PAGES, 1003, async_scheduling)


@pytest.mark.parametrize(("overlap", "steps"), [(False, 1), (True, 1), (True, 4)])
def test_all_at_once_matches_run_to_completion(overlap, steps):
    """With `steps` > 1 the tail runs multi-step launches (each a decision of its own)."""
    work = _workload(24, seed=1)
    ref_steps = []
    s = make_scheduler(NUM_PAGES, **CONFIG, num_scheduler_steps=steps)
    reqs = [make_request(f"r{i}", p, o) for i, (p, o) in enumerate(work)]
    launches = []

    def on_step(s, plan):
        ref_steps.append((tuple(r[1:] for r in plan.request_ids), tuple(plan.num_scheduled_tokens)))
        launches.append(plan.num_steps)

    done = run_to_completion(s, reqs, on_step=on_step, overlap=overlap)
    assert s.counters.num_preemptions > 0 and s.counters.prefix_cache_hits > 0
    assert (max(launches) > 1) == (steps > 1)

    sim = simulate(
        _sim_engine(overlap, num_scheduler_steps=steps),
        StepCosts(DEVICE),
        [SimRequest(p, o, 0.0) for p, o in work],
        request_rate=math.inf,
        record_steps=True,
    )
    assert sim.decisions == ref_steps
    assert sim.stats.steps == len(ref_steps)
    assert sim.stats.num_preemptions == s.counters.num_preemptions
    want = [len(done[f"r{i}"].output_token_ids) for i in range(len(work))]
    assert [len(t) for t in sim.token_times] == want


class ClockedFakeDevice:
    """The fake runner's device, each step taking `step_time(plan)` seconds of virtual time."""

    num_recompiles = 0

    def __init__(self, scheduler, step_time):
        self.device = FakeDevice(scheduler)
        self.step_time = step_time
        self.now = self.free = 0.0
        self.steps = []

    def launch(self, plan):
        self.steps.append(
            (tuple(r[1:] for r in plan.request_ids), tuple(plan.num_scheduled_tokens))
        )
        self.now += HOST_S
        tokens = self.device.execute(plan)
        self.free = max(self.now, self.free) + self.step_time(plan)
        return tokens, self.free

    def fetch(self, handle):
        tokens, done = handle
        self.now = max(self.now, done)
        return tokens, np.zeros(len(tokens), np.float32)


def reference_run(work, arrivals, overlap):
    """The engine-core process's loop (engine_core_process._serve) over the clocked fake."""
    s = make_scheduler(NUM_PAGES, **CONFIG)
    ex = ClockedFakeDevice(s, lambda plan: DEVICE.predict(step_features(plan)))
    core = EngineCore(s, s._builder, ex, async_scheduling=overlap)
    times = {f"r{i}": [] for i in range(len(work))}
    nxt = 0
    while True:
        while nxt < len(work) and arrivals[nxt] <= ex.now:
            prompt, out_len = work[nxt]
            params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
            core.add_request(
                EngineCoreRequest(f"r{nxt}", prompt, params, 0, [], float(arrivals[nxt]))
            )
            nxt += 1
        if core.has_unfinished():
            out = core.step()
        elif core.has_in_flight:
            out = core.drain()
        elif nxt < len(work):
            ex.now = float(arrivals[nxt])
            continue
        else:
            break
        for rid in out.request_ids:
            times[rid].append(ex.now)
    assert s.counters.num_preemptions > 0 and s.counters.prefix_cache_hits > 0
    return ex.steps, [times[f"r{i}"] for i in range(len(work))]


@pytest.mark.parametrize("overlap", [False, True])
def test_arrivals_over_time_match_the_fake_runner_in_virtual_time(overlap):
    work = _workload(60, seed=2)
    rng = np.random.default_rng(3)
    arrivals = np.cumsum(rng.exponential(1 / 400.0, len(work)))  # bursts: queues form and drain
    ref_steps, ref_times = reference_run(work, arrivals, overlap)

    costs = StepCosts(DEVICE, schedule=LinearModel(HOST_TERMS, (HOST_S, 0.0, 0.0)))
    requests = [SimRequest(p, o, float(t)) for (p, o), t in zip(work, arrivals, strict=True)]
    sim = simulate(_sim_engine(overlap), costs, requests, request_rate=400.0, record_steps=True)

    assert sim.decisions == ref_steps
    assert sim.stats.steps == len(ref_steps)
    for got, want in zip(sim.token_times, ref_times, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=0)
    # The reported metrics are those times, measured from each arrival.
    ttft = [t[0] - a for t, a in zip(ref_times, arrivals, strict=True)]
    assert sim.run.metrics["p99_ttft_ms"] == pytest.approx(1e3 * np.percentile(ttft, 99))
    assert sim.run.metrics["completed"] == len(work)
