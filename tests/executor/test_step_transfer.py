"""`NORI_JAX_STEP_TRANSFER=pinned_host`: each step's buffer is put in pinned host memory and the
staging program moves it to the device. The engine answers as with the default (device memory):
the same tokens, greedy and seeded, the step buffer still at one device address, no recompiles;
a memory kind it does not know is refused by name."""

from __future__ import annotations

import numpy as np
import pytest
from engine_fixtures import small_llm

from nori_jax import SamplingParams
from nori_jax.executor.placement import step_transfer_memory

PARAMS = [
    SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=10, temperature=0.9, top_p=0.8, seed=4, ignore_eos=True),
]


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [rng.integers(3, 200, int(rng.integers(2, 40))).tolist() for _ in range(6)]


def _run(monkeypatch, memory: str) -> tuple[list[list[int]], str, bool]:
    monkeypatch.setenv("NORI_JAX_STEP_TRANSFER", memory)
    llm = small_llm("tiny-llama")
    runner = llm.engine.runner
    address = runner._step_state.unsafe_buffer_pointer()
    outs = llm.generate(_prompts(), PARAMS * 3)
    assert llm.engine.num_recompiles == 0
    fresh = runner._put_step(runner.layout.new_step())
    same_place = runner._step_state.unsafe_buffer_pointer() == address
    return [o.token_ids for o in outs], fresh.sharding.memory_kind, same_place


def test_pinned_host_step_buffers_answer_as_device_ones(monkeypatch):
    tokens, kind, same_place = _run(monkeypatch, "device")
    assert kind == "device" and same_place
    pinned, kind, same_place = _run(monkeypatch, "pinned_host")
    assert kind == "pinned_host" and same_place
    assert pinned == tokens


def test_an_unknown_memory_kind_is_refused(monkeypatch):
    monkeypatch.setenv("NORI_JAX_STEP_TRANSFER", "unified")
    with pytest.raises(ValueError, match="NORI_JAX_STEP_TRANSFER='unified'"):
        step_transfer_memory()
