"""Step features, the linear step model and its fit, calibration files and their lookup."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from fake_runner import make_request, make_scheduler, run_to_completion
from plan_helpers import COSTS, DEVICE, synthetic_calibration

from nori_jax.bench.offline import OfflineConfig
from nori_jax.bench.workload import WorkloadConfig
from nori_jax.plan.calibration import (
    CALIBRATION_DIR,
    CalibrationKey,
    CalibrationQuery,
    find_calibration,
    find_calibrations,
    load_calibration,
    save_calibration,
)
from nori_jax.plan.features import StepFeatures, step_features, step_features_from_buffers
from nori_jax.plan.planner import Planner, PlanSettings
from nori_jax.plan.step_model import DEVICE_TERMS, LinearModel


def test_features_from_the_rows_equal_what_the_buffers_tell_the_device():
    rng = np.random.default_rng(0)
    reqs = [
        make_request(f"r{i}", rng.integers(3, 900, int(rng.integers(1, 120))).tolist(), 12)
        for i in range(30)
    ]
    seen = []

    def check(s, plan):
        f = step_features(plan)
        assert f == step_features_from_buffers(plan)
        seen.append(f)

    run_to_completion(make_scheduler(48), reqs, on_step=check, overlap=True)
    assert any(f.prefill_tokens and f.num_decodes for f in seen)  # mixed steps were covered


def test_features_of_a_known_step():
    # One decode at position 9 (kv 10) and a chunk of 16 tokens after 32 cached ones (kv 48).
    s = make_scheduler(64, page_size=16)
    s.add_request(make_request("a", list(range(3, 12)), 4))
    out = s.schedule()
    s.update(out, np.full(s.config.max_num_seqs, 5, np.int32))
    s.add_request(make_request("b", list(range(3, 51)), 4))  # 48 tokens: one 48-token chunk
    plan = s._builder.build(s.schedule())
    f = step_features(plan)
    assert (f.num_decodes, f.num_rows, f.prefill_tokens, f.num_tokens) == (1, 2, 48, 49)
    assert f.decode_kv_tokens == 10
    assert f.prefill_pairs == 48 * 49 // 2  # causal over the chunk from position 0
    assert f.bucket == 64


def _random_features(n: int, seed: int) -> list[StepFeatures]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        d, p = int(rng.integers(0, 200)), int(rng.integers(0, 3))
        chunk = [int(rng.integers(2, 500)) for _ in range(p)]
        tokens = d + sum(chunk)
        out.append(
            StepFeatures(
                bucket=int(2 ** np.ceil(np.log2(max(tokens, 16)))),
                num_tokens=tokens,
                num_rows=d + p,
                num_decodes=d,
                prefill_tokens=sum(chunk),
                decode_kv_tokens=int(rng.integers(d, d * 4000 + 1)),
                prefill_pairs=sum(q * (q + 1) // 2 + q * int(rng.integers(0, 2000)) for q in chunk),
            )
        )
    return out


def test_fit_recovers_the_coefficients_of_noiseless_profiles():
    feats = _random_features(60, seed=1)
    fitted = LinearModel.fit(DEVICE_TERMS, feats, DEVICE.predict_many(feats))
    np.testing.assert_allclose(fitted.coefficients, DEVICE.coefficients, rtol=1e-6)


def test_fit_keeps_coefficients_non_negative_and_zero_for_unexercised_terms():
    feats = [f for f in _random_features(80, seed=2) if not f.prefill_tokens]
    rng = np.random.default_rng(3)
    times = DEVICE.predict_many(feats) * rng.uniform(0.9, 1.1, len(feats))
    fitted = LinearModel.fit(DEVICE_TERMS, feats, times).to_dict()
    assert all(c >= 0 for c in fitted.values())
    assert fitted["prefill_pairs"] == 0.0  # never exercised: no prefill in these profiles


def test_fit_rejects_too_few_profiles_and_bad_times():
    feats = _random_features(3, seed=4)
    with pytest.raises(ValueError, match="at least as many profiles"):
        LinearModel.fit(DEVICE_TERMS, feats, [1e-3] * 3)
    with pytest.raises(ValueError, match="finite"):
        LinearModel.fit(("step",), feats, [1e-3, float("nan"), 1e-3])


def test_model_rejects_negative_or_unknown_terms():
    with pytest.raises(ValueError, match="coefficient of 'step'"):
        LinearModel(("step",), (-1.0,))
    with pytest.raises(ValueError, match="unknown model term 'flops'"):
        LinearModel(("flops",), (1.0,))


def test_calibration_file_round_trips(tmp_path):
    cal = synthetic_calibration()
    path = save_calibration(cal, tmp_path / "c.yaml", header="made by a test")
    assert path.read_text().startswith("# made by a test\n")
    back = load_calibration(path)
    assert back.key == cal.key and back.engine == cal.engine
    assert back.costs.device.terms == COSTS.device.terms
    np.testing.assert_allclose(back.costs.device.coefficients, COSTS.device.coefficients, 1e-4)
    assert back.kv_transfer == cal.kv_transfer and back.path == str(path)


def test_uncalibrated_combinations_are_clear_errors(tmp_path):
    cal = synthetic_calibration()
    save_calibration(cal, tmp_path / cal.key.filename)
    assert find_calibration(CalibrationQuery(model="tiny-llama"), directory=tmp_path) is not None
    with pytest.raises(ValueError) as e:
        find_calibration(CalibrationQuery(model="tiny-llama", kv_dtype="fp8"), directory=tmp_path)
    msg = str(e.value)
    assert msg.startswith("uncalibrated combination: model=tiny-llama kv_dtype=fp8")
    assert "model=tiny-llama dtype=float32 kv_dtype=float32 device=cpu tp=1" in msg  # what is
    assert "nori-jax plan calibrate" in msg  # and how to record the missing one
    with pytest.raises(ValueError, match="uncalibrated combination: model=llama3.2-1b"):
        find_calibrations(CalibrationQuery(model="llama3.2-1b"), path=tmp_path / cal.key.filename)
    with pytest.raises(ValueError, match=r"uncalibrated combination: tp=2 .*calibrated in"):
        find_calibration(CalibrationQuery(tp=2), directory=tmp_path)
    with pytest.raises(ValueError, match="uncalibrated combination"):
        find_calibration(CalibrationQuery(model="x"), directory=tmp_path / "empty")
    with pytest.raises(ValueError, match="unknown dtype 'fp7'"):
        CalibrationQuery(kv_dtype="fp7").matches(cal.key)


def test_bad_calibration_files_name_what_is_wrong(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("format: 1\nkey: {model: m, dtype: bfloat16, kv_dtype: bfloat16, device: x}\n")
    with pytest.raises(ValueError, match="missing key 'engine'"):
        load_calibration(p)
    p.write_text("format: 7\n")
    with pytest.raises(ValueError, match="format 7"):
        load_calibration(p)
    with pytest.raises(ValueError, match="not found"):
        load_calibration(tmp_path / "nope.yaml")


@pytest.mark.parametrize("model", ["smollm2-135m", "llama3.2-1b"])
def test_the_shipped_h200_files_are_recorded_and_replay_their_checks(model: str):
    key = CalibrationKey(model, "bfloat16", "bfloat16", "nvidia-h200", 1)
    shipped = load_calibration(CALIBRATION_DIR / key.filename)
    assert not shipped.derived and "plan calibrate" in shipped.source and shipped.key == key
    # The recorded overlapped-loop checks: the fitted model's replay of each within 25%.
    assert len(shipped.check) >= 10
    for c in shipped.check:
        assert c["predicted_ms"] == pytest.approx(c["measured_ms"], rel=0.25)
    w = WorkloadConfig(dataset="fixed", num_prompts=2, input_len=8, output_len=2)
    assert not Planner(shipped, PlanSettings(OfflineConfig(w))).warnings
    derived = dataclasses.replace(shipped, derived=True)
    assert "is derived" in Planner(derived, PlanSettings(OfflineConfig(w))).warnings[0]


def test_unnamed_kv_pages_pick_the_calibration_in_the_weights_dtype(tmp_path):
    """Two calibrations of one model, its pages in the weights' dtype and in fp8: without
    --kv-dtype the engine's default ("auto": the weights' dtype) is the one meant (the docs'
    first `plan simulate --model smollm2-135m` was refused as ambiguous); named, either."""
    import dataclasses

    plain = synthetic_calibration()
    fp8 = dataclasses.replace(plain, key=dataclasses.replace(plain.key, kv_dtype="float8_e4m3fn"))
    for cal in (plain, fp8):
        save_calibration(cal, tmp_path / cal.key.filename)
    found = find_calibration(CalibrationQuery(model="tiny-llama"), directory=tmp_path)
    assert found.key.kv_dtype == "float32"
    named = find_calibration(
        CalibrationQuery(model="tiny-llama", kv_dtype="fp8"), directory=tmp_path
    )
    assert named.key.kv_dtype == "float8_e4m3fn"
