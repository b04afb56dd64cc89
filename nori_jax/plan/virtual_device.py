"""The simulated device: an Executor (core/engine_core.py) that runs steps in virtual time.

`launch` advances the host's clock by the step model's schedule and launch costs (after waiting
out `launch_wait` of the device's remaining work on the step before) and queues the step on a
device that runs steps in order, each for its modelled device time; `fetch` waits for the step on
the clock and adds the post-processing cost. Every sample is the same token: no EOS is
configured, so only lengths end requests. Imports nothing of the bench (calibrate uses it too).

A multi-step launch (`num_scheduler_steps`) is modelled as its k decode steps back to back on
the device, each with its rows' KV one token longer, for one launch's host costs: the
calibration profiles single steps only, so this part of a prediction is not validated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from nori_jax.core.step_plan import StepPlan
from nori_jax.plan.features import StepFeatures, step_features
from nori_jax.plan.step_model import StepCosts

OUTPUT_TOKEN = 7


class SimClock:
    def __init__(self) -> None:
        self.now = 0.0  # the host's time
        self.device_free = 0.0  # when the device finishes the last launched step
        self.device_busy = 0.0
        self.host_busy = 0.0


class SimExecutor:
    """An Executor (core/engine_core.py) that runs steps in virtual time."""

    num_recompiles = 0

    def __init__(
        self,
        costs: StepCosts,
        clock: SimClock,
        max_num_seqs: int,
        feature_max: Mapping[str, float] | None = None,
        record: bool = False,
    ):
        self.costs, self.clock = costs, clock
        self.tokens = np.full(max_num_seqs, OUTPUT_TOKEN, np.int32)
        self.logprobs = np.zeros(max_num_seqs, np.float32)
        # 10% past the largest profiled value is still "calibrated": a profile grid is coarse.
        self.limits = {k: 1.1 * v for k, v in (feature_max or {}).items()}
        self.beyond = 0
        self.record = record
        self.decisions: list[tuple[tuple[str, ...], tuple[int, ...]]] = []
        self.features: list[StepFeatures] = []

    def launch(self, plan: StepPlan) -> tuple[float, StepFeatures, int]:
        if self.record:
            self.decisions.append((tuple(plan.request_ids), tuple(plan.num_scheduled_tokens)))
        return self.launch_features(step_features(plan), plan.num_steps)

    def launch_features(
        self, f: StepFeatures, num_steps: int = 1
    ) -> tuple[float, StepFeatures, int]:
        c, costs = self.clock, self.costs
        schedule, launch = costs.schedule.predict(f), costs.launch.predict(f)
        c.now += schedule
        if costs.launch_wait:
            c.now += costs.launch_wait * max(0.0, c.device_free - c.now)
        c.now += launch
        c.host_busy += schedule + launch
        device = self.costs.device.predict(f)
        for i in range(1, num_steps):  # a multi-step launch: each step reads one more KV token
            grown = dataclasses.replace(f, decode_kv_tokens=f.decode_kv_tokens + i * f.num_decodes)
            device += self.costs.device.predict(grown)
        c.device_free = max(c.now, c.device_free) + device
        c.device_busy += device
        if any(getattr(f, k) > v for k, v in self.limits.items()):
            self.beyond += 1
        if self.record:
            self.features.append(f)
        return c.device_free, f, num_steps

    def fetch(self, handle: tuple[float, StepFeatures, int]) -> tuple[np.ndarray, np.ndarray]:
        done, f, num_steps = handle
        c = self.clock
        c.now = max(c.now, done)
        post = self.costs.postprocess.predict(f)
        c.now += post
        c.host_busy += post
        if num_steps > 1:
            return np.tile(self.tokens, (num_steps, 1)), np.tile(self.logprobs, (num_steps, 1))
        return self.tokens, self.logprobs


def loop_seconds(costs: StepCosts, features: Sequence[StepFeatures], overlapped: bool) -> float:
    """Host time of engine iterations that launch these steps back to back, as the simulator
    counts it: with `overlapped`, iteration k launches step k and then fetches step k - 1."""
    clock = SimClock()
    ex = SimExecutor(costs, clock, 1)
    pending = None
    for f in features:
        handle = ex.launch_features(f)
        if not overlapped:
            ex.fetch(handle)
            continue
        if pending is not None:
            ex.fetch(pending)
        pending = handle
    return clock.now
