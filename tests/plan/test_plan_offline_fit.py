"""The mixed-step device term: its feature, its calibration key, its fit to an offline run."""

from __future__ import annotations

import math

import pytest
from plan_helpers import DEVICE, synthetic_calibration

from nori_jax.bench.offline import OfflineConfig
from nori_jax.bench.workload import WorkloadConfig
from nori_jax.plan.calibration import load_calibration, save_calibration
from nori_jax.plan.features import StepFeatures
from nori_jax.plan.offline_fit import (
    TERM,
    fit_mixed_kv,
    offline_tpot,
    replay_offline,
    with_mixed_kv,
)
from nori_jax.plan.planner import Planner, PlanSettings

DECODE_ONLY = StepFeatures(64, 40, 40, 40, 0, 40_000, 0)
MIXED = StepFeatures(128, 104, 41, 40, 64, 40_000, 64 * 65 // 2)
# Queued at once, more requests than sequences: admissions land beside running decodes.
SHAPING = OfflineConfig(
    WorkloadConfig(dataset="fixed", num_prompts=48, input_len=150, output_len=30)
)


def test_the_feature_is_the_decode_kv_of_steps_that_also_prefill():
    assert DECODE_ONLY.mixed_decode_kv_tokens == 0
    assert MIXED.mixed_decode_kv_tokens == 40_000
    cal = with_mixed_kv(synthetic_calibration(), 1e-8)
    device = cal.costs.device
    assert device.predict(DECODE_ONLY) == pytest.approx(DEVICE.predict(DECODE_ONLY))
    assert device.predict(MIXED) == pytest.approx(DEVICE.predict(MIXED) + 40_000 * 1e-8)


def test_a_calibration_keeps_the_term_through_its_file(tmp_path):
    cal = with_mixed_kv(synthetic_calibration(), 2.5e-9, "offline.json")
    path = save_calibration(cal, tmp_path / "cal.yaml")
    back = load_calibration(path)
    assert back.costs.device.to_dict()[TERM] == pytest.approx(2.5e-9)
    assert "offline.json" in back.source
    again = with_mixed_kv(back, 1e-9)  # replaced, not added twice
    assert list(again.costs.device.to_dict()).count(TERM) == 1
    assert again.costs.device.to_dict()[TERM] == 1e-9
    with pytest.raises(ValueError, match=">= 0"):
        with_mixed_kv(cal, -1e-9)


def _offline(cal) -> tuple[float, int]:
    return replay_offline(SHAPING)(cal)


def test_the_fit_recovers_the_term_an_offline_run_was_made_with():
    cal = synthetic_calibration()
    base_ms, steps = _offline(cal)
    measured_ms, measured_steps = _offline(with_mixed_kv(cal, 1e-7))
    assert measured_steps == steps  # queued at once: the decisions do not depend on time
    assert measured_ms > 1.05 * base_ms  # the workload has mixed steps for the term to act on
    fit = fit_mixed_kv(cal, _offline, measured_ms, measured_steps, rel_tol=0.001)
    assert fit.seconds_per_token == pytest.approx(1e-7, rel=0.05)
    assert fit.simulated_tpot_ms == pytest.approx(measured_ms, rel=0.001)
    assert fit.without_term_ms == pytest.approx(base_ms)


def test_a_run_no_slower_than_its_replay_gives_no_term():
    cal = synthetic_calibration()
    base_ms, steps = _offline(cal)
    fit = fit_mixed_kv(cal, _offline, 0.9 * base_ms, steps)
    assert fit.seconds_per_token == 0.0


def test_another_step_count_is_another_workload():
    cal = synthetic_calibration()
    _, steps = _offline(cal)
    with pytest.raises(ValueError, match="not the same workload"):
        fit_mixed_kv(cal, _offline, 10.0, steps + 1)


def test_the_term_lengthens_served_steps_that_mix():
    # At a rate where arrivals land beside running decodes, the term makes TPOT longer.
    w = WorkloadConfig(dataset="fixed", num_prompts=60, input_len=150, output_len=30)
    settings = PlanSettings(shaping=OfflineConfig(w))
    cal = synthetic_calibration()
    plain = Planner(cal, settings).run_at(400.0).run.metrics["mean_tpot_ms"]
    mixed = Planner(with_mixed_kv(cal, 1e-7), settings).run_at(400.0).run.metrics["mean_tpot_ms"]
    assert mixed > 1.05 * plain


def test_offline_tpot_reads_a_bench_offline_result():
    result = {"num_requests": 2000, "steps": 2388, "latency_ms": {"tpot_all": {"p50": 10.1}}}
    assert offline_tpot(result) == (10.1, 2388, 2000)
    with pytest.raises(ValueError, match="not a bench offline result"):
        offline_tpot({"steps": 3})
    assert math.isfinite(offline_tpot(result)[0])
