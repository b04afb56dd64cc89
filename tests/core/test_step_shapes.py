"""Wall time by step shape (core/step_shapes.py): which steps the engine core counts under which
token bucket and kind, and which interval it charges each, on a fake clock that advances only
while the fake device runs a step (and while the engine sits idle between requests)."""

from __future__ import annotations

import time
import types

import pytest
from fake_runner import FakeDevice, FakeExecutor, make_scheduler

from nori_jax.core import engine_core
from nori_jax.core.engine_core import EngineCore, EngineCoreRequest
from nori_jax.core.step_shapes import STEP_KINDS, ShapeTimes, StepShape, StepShapes, step_kind
from nori_jax.sampling_params import SamplingParams

MS_PER_BUCKET_TOKEN = 1e-3  # the fake device: a step of bucket T takes T ms


class Clock:
    def __init__(self):
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now


class TimedExecutor(FakeExecutor):
    """The fake device, taking bucket-token milliseconds of the fake clock per step, spent when
    the host waits for it (the fetch)."""

    def __init__(self, device: FakeDevice, clock: Clock):
        super().__init__(device)
        self.clock = clock
        self.device_seconds: dict[StepShape, float] = {}

    def launch(self, plan):
        kind = step_kind(plan.scheduled.num_decodes, len(plan.scheduled.prefills))
        shape = StepShape(plan.bucket, kind, plan.num_steps)
        return self.device.execute(plan), shape

    def fetch(self, handle):
        tokens, shape = handle
        seconds = shape.bucket * MS_PER_BUCKET_TOKEN
        self.clock.now += seconds
        self.device_seconds[shape] = self.device_seconds.get(shape, 0.0) + seconds
        return super().fetch(tokens)


def make_core(monkeypatch, overlap: bool) -> tuple[EngineCore, TimedExecutor, Clock]:
    clock = Clock()
    monkeypatch.setattr(engine_core, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    s = make_scheduler(max_num_batched_tokens=64)
    executor = TimedExecutor(FakeDevice(s), clock)
    return EngineCore(s, s._builder, executor, async_scheduling=overlap), executor, clock


def request(rid: str, n: int, max_tokens: int) -> EngineCoreRequest:
    p = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return EngineCoreRequest(rid, list(range(5, 5 + n)), p, 0, [], time.monotonic())


def run(core: EngineCore) -> None:
    while core.has_unfinished():
        core.step()
    core.drain()


@pytest.mark.parametrize("overlap", [False, True])
def test_each_step_is_charged_its_device_time_under_its_shape(monkeypatch, overlap):
    core, executor, clock = make_core(monkeypatch, overlap)
    core.add_request(request("long", 100, 12))  # prefill chunks of 64 and 36 tokens
    core.add_request(request("short", 9, 30))  # prefilled beside the second chunk
    for _ in range(3):
        core.step()
    core.add_request(request("mixed", 40, 4))  # prefilled beside their decodes
    run(core)
    # Idle: an hour passes with nothing on the device; then a request that decodes alone.
    clock.now += 3600.0
    core.add_request(request("late", 20, 5))
    run(core)

    got = core.step_shapes.by_shape
    assert {s: t.seconds for s, t in got.items()} == pytest.approx(executor.device_seconds)
    assert sum(t.launches for t in got.values()) == core.step_times.steps
    assert sum(t.tokens for t in got.values()) == core.step_times.tokens
    kinds = {s.kind for s in got}
    assert kinds == {"decode", "mixed", "prefill"}
    assert all(s.bucket in core.scheduler.buckets and s.num_steps == 1 for s in got)
    # The first two steps prefill only: a 64-token chunk, then 36 + 9 tokens.
    assert got[StepShape(64, "prefill")].launches == 2
    assert got[StepShape(64, "prefill")].tokens == 64 + 36 + 9


def test_shapes_of_a_later_run_are_its_own():
    a = StepShapes()
    a.observe(StepShape(16, "decode"), 9, 0.5)
    before = a.copy()
    a.observe(StepShape(16, "decode"), 11, 0.25)
    a.observe(StepShape(64, "mixed"), 40, 1.0)
    run = a.minus(before)
    assert run.by_shape == {
        StepShape(16, "decode"): ShapeTimes(1, 11, 0.25),
        StepShape(64, "mixed"): ShapeTimes(1, 40, 1.0),
    }
    assert before.by_shape == {StepShape(16, "decode"): ShapeTimes(1, 9, 0.5)}  # a copy
    rows = run.rows()
    assert [(r["bucket"], r["kind"]) for r in rows] == [(16, "decode"), (64, "mixed")]
    assert [r["share"] for r in rows] == pytest.approx([0.2, 0.8])
    assert rows[1]["ms_per_launch"] == pytest.approx(1000.0)
    assert rows[1]["tokens_per_launch"] == 40
    merged = StepShapes.merged([run, before])
    assert merged.by_shape[StepShape(16, "decode")] == ShapeTimes(2, 20, 0.75)


def test_step_kind():
    assert [step_kind(5, 0), step_kind(5, 1), step_kind(0, 2)] == list(STEP_KINDS)
