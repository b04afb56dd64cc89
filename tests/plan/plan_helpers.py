"""A synthetic calibration (known coefficients) for fast planner tests."""

from __future__ import annotations

import dataclasses

from nori_jax.plan.calibration import CalibratedEngine, Calibration, CalibrationKey, KVTransfer
from nori_jax.plan.step_model import DEVICE_TERMS, HOST_TERMS, LinearModel, StepCosts

# device: 1 ms a step, 2 us per bucket token, 20 ns per decode KV token, 1 ns per prefill pair,
# 1 us per row; host: 0.1 ms + 1 us per row + 0.1 us per token, each stage.
DEVICE = LinearModel(DEVICE_TERMS, (1e-3, 2e-6, 2e-8, 1e-9, 1e-6))
HOST = LinearModel(HOST_TERMS, (1e-4, 1e-6, 1e-7))
COSTS = StepCosts(DEVICE, HOST, HOST, HOST)


def synthetic_calibration(costs: StepCosts = COSTS, **engine) -> Calibration:
    settings = dict(
        page_size=16,
        num_pages=513,
        max_model_len=1024,
        max_num_seqs=32,
        max_num_batched_tokens=256,
        vocab_size=512,
        kv_bytes_per_token=512,
    )
    settings.update(engine)
    return Calibration(
        CalibrationKey("tiny-llama", "float32", "float32", "cpu", 1),
        CalibratedEngine(**settings),
        costs,
        feature_max={},
        source="synthetic (tests)",
        kv_transfer=KVTransfer(1e9, 1e-3, "given"),
    )


def with_costs(cal: Calibration, **changes) -> Calibration:
    return dataclasses.replace(cal, costs=dataclasses.replace(cal.costs, **changes))
