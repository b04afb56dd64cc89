"""No request can take the engine core down: it vets each request at entry (a copy of its
settings, checked against what its arrays hold) and fails alone a request whose settings cannot
enter the step; the other requests' tokens are exactly what they would have been."""

from __future__ import annotations

import time

import pytest
from fake_runner import VOCAB, FakeDevice, FakeExecutor, expected_output, make_scheduler

from nori_jax.core.engine_core import EngineCore, EngineCoreRequest
from nori_jax.core.scheduler_output import Acquire
from nori_jax.sampling_params import ParameterError, SamplingParams

POISON_SEED = 666


def make_core(overlap: bool) -> EngineCore:
    s = make_scheduler()
    return EngineCore(s, s._builder, FakeExecutor(FakeDevice(s)), async_scheduling=overlap)


def request(rid: str, prompt: list[int], seed: int = 0, **params) -> EngineCoreRequest:
    p = SamplingParams(**({"max_tokens": 8, "temperature": 0.0} | params))
    return EngineCoreRequest(rid, prompt, p, seed, [], time.monotonic())


def run(core: EngineCore) -> tuple[dict[str, list[int]], dict]:
    tokens: dict[str, list[int]] = {}
    finished = {}
    while core.has_unfinished() or core.has_in_flight:
        out = core.step() if core.has_unfinished() else core.drain()
        for rid, tok in zip(out.request_ids, out.token_ids.tolist(), strict=True):
            tokens.setdefault(rid, []).append(tok)
        finished |= {f.request_id: f for f in out.finished}
    return tokens, finished


@pytest.mark.parametrize("overlap", [False, True])
def test_a_request_whose_settings_cannot_enter_the_step_fails_alone(monkeypatch, overlap):
    core = make_core(overlap)
    real_apply = core.builder.apply

    def apply(events):
        if any(isinstance(ev, Acquire) and ev.seed == POISON_SEED for ev in events):
            raise OverflowError("injected: this seed does not fit")
        real_apply(events)

    monkeypatch.setattr(core.builder, "apply", apply)
    prompts = {f"r{i}": list(range(10 + i, 30 + 7 * i)) for i in range(4)}
    for rid, prompt in prompts.items():
        core.add_request(request(rid, prompt, POISON_SEED if rid == "r2" else 0))
    tokens, finished = run(core)

    assert finished["r2"].finish_reason == "error"
    assert "injected" in finished["r2"].error
    assert "r2" not in tokens  # its discarded sample never reaches the outputs
    for rid in ("r0", "r1", "r3"):
        assert finished[rid].finish_reason == "length"
        assert tokens[rid] == expected_output(prompts[rid], 8)
    core.scheduler.check_invariants()
    assert core.scheduler.allocator.num_used_pages == 0
    # The loop goes on: a later request is served as usual.
    core.add_request(request("after", [5, 6, 7]))
    tokens, finished = run(core)
    assert tokens["after"] == expected_output([5, 6, 7], 8)


@pytest.mark.parametrize(
    ("req", "param"),
    [
        (request("a", [1, VOCAB]), "prompt"),  # an id outside the vocabulary
        (request("a", []), "prompt"),
        (request("a", [1] * 256), "prompt"),  # max_model_len 256: no room to generate
        (request("a", [1, 2], seed=2**31), "seed"),
        (request("a", [1, 2], stop_token_ids=[VOCAB]), "stop_token_ids"),
    ],
)
def test_the_core_vets_each_request(req: EngineCoreRequest, param: str) -> None:
    core = make_core(True)
    with pytest.raises(ParameterError) as e:
        core.add_request(req)
    assert e.value.param == param
    assert not core.has_unfinished()


def test_settings_changed_after_adding_change_nothing() -> None:
    """The core keeps a validated copy: a caller's later change neither reaches the step nor
    bypasses the checks."""
    core = make_core(True)
    r = request("a", [3, 4, 5])
    core.add_request(r)
    r.params.top_k = 2**40
    r.params.max_tokens = 1
    tokens, finished = run(core)
    assert tokens["a"] == expected_output([3, 4, 5], 8)
    bad = request("b", [3, 4, 5])
    bad.params.top_k = 2**40
    with pytest.raises(ParameterError, match="top_k"):
        core.add_request(bad)
