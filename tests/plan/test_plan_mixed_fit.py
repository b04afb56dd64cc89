"""The mixed-step term from calibrate's own profiles: the fit recovers a known cost from the
steps the real scheduler takes for the default grid on the H200 engine (a dry run, no device),
the grid's mixed steps span the decode KV of served steps near the knee, the shipped H200 files
carry the term their own mixed profiles fitted, and a file recorded before calibrate fitted it
has none (0)."""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
import pytest

from nori_jax.plan.calibrate import ProfileGrid, dry_run, fit
from nori_jax.plan.calibration import CALIBRATION_DIR, load_calibration
from nori_jax.plan.features import StepFeatures
from nori_jax.plan.offline_fit import TERM, calibrated_mixed_kv, with_mixed_kv
from nori_jax.plan.step_model import CALIBRATED_DEVICE_TERMS, LinearModel
from nori_jax.plan.whatif import sim_engine

H200_135M = CALIBRATION_DIR / "smollm2-135m_bfloat16_kv-bfloat16_nvidia-h200_tp1.yaml"
MIXED_KV = 1.5e-9  # s per decode KV token of a mixed step: the offline fits' order (1.5-1.75 ns)


@pytest.fixture(scope="module")
def h200():
    """The shipped 135M file, the steps the default grid takes on its engine, and without the
    mixed phase."""
    cal = load_calibration(H200_135M)
    engine, _ = sim_engine(cal)
    return (
        cal,
        dry_run(engine, ProfileGrid())[0],
        dry_run(engine, ProfileGrid(mixed_batches=()))[0],
    )


def _profiles(cal, profiles, mixed_kv: float, noise: float, seed: int = 0):
    """The profiles with device times of the shipped model plus a known mixed-step cost,
    times log-normal noise of `noise` (the H200 fits' median error is 2-4%)."""
    coefficients = {**cal.costs.device.to_dict(), TERM: mixed_kv}
    truth = LinearModel(
        CALIBRATED_DEVICE_TERMS, tuple(coefficients[t] for t in CALIBRATED_DEVICE_TERMS)
    ).predict_many([p.features for p in profiles])
    rng = np.random.default_rng(seed)
    times = truth * np.exp(rng.normal(0.0, noise, len(truth)))
    return [
        dataclasses.replace(
            p, device_s=float(t), schedule_s=1e-4, launch_s=1e-3, postprocess_s=1e-4
        )
        for p, t in zip(profiles, times, strict=True)
    ]


def test_the_mixed_phase_adds_only_mixed_steps_spanning_the_knee(h200):
    _, grid, without = h200
    phases = collections.Counter(p.phase for p in grid)
    assert phases == collections.Counter(p.phase for p in without) + collections.Counter(
        mixed=phases["mixed"]
    )
    assert phases["mixed"] <= 80  # every mixed batch beside decoders the grid filled anyway
    shapes = {p.shape for p in grid if p.phase == "mixed"}
    assert shapes == {f"mixed {b} x {c}" for b in (32, 256, 1023) for c in (256, 1024, 4096)} - {
        "mixed 1023 x 4096"  # 1,024 x 4,096 does not fit the bf16 pool
    }
    kv = [p.features.mixed_decode_kv_tokens for p in grid if p.phase == "mixed"]
    kv = [k for k in kv if k]
    # Near the 135M knee (192-256 req/s simulated) mixed steps hold 230-630 decoders and 0.2-0.6M
    # decode KV tokens; every request queued at once, 1,017 and 0.9M: bracketed and sampled.
    assert min(kv) < 10_000 and max(kv) > 1_000_000
    assert sum(1 for k in kv if 200_000 <= k <= 600_000) >= 10


@pytest.mark.parametrize("noise", [0.0, 0.05])
def test_the_fit_recovers_a_known_mixed_step_cost(h200, noise):
    cal, grid, _ = h200
    costs, quality = fit(_profiles(cal, grid, MIXED_KV, noise))
    fitted = costs.device.to_dict()
    assert fitted[TERM] == pytest.approx(MIXED_KV, rel=1e-6 if noise == 0 else 0.15)
    # and the rest of the device model with it
    for term, c in cal.costs.device.to_dict().items():
        if term != TERM and c > 1e-3 * max(cal.costs.device.coefficients):
            assert fitted[term] == pytest.approx(c, rel=1e-6 if noise == 0 else 0.25), term
    mixed, without = quality["device_mixed_steps"], quality["device_mixed_steps_no_term"]
    assert mixed["median_rel_error"] < without["median_rel_error"]


def test_no_mixed_step_cost_fits_a_term_near_zero(h200):
    cal, grid, _ = h200
    for noise in (0.0, 0.05):
        fitted = fit(_profiles(cal, grid, 0.0, noise, seed=1))[0].device.to_dict()
        assert 0.0 <= fitted[TERM] < 0.1 * MIXED_KV


MIXED = StepFeatures(8192, 8192, 1001, 1000, 7192, 1_000_000, 7192 * 7193 // 2)


@pytest.mark.parametrize(
    "name", ["smollm2-135m", "llama3.2-1b"], ids=lambda n: f"{n}_bfloat16_nvidia-h200"
)
def test_the_shipped_bf16_h200_files_carry_their_calibrated_term(name):
    cal = load_calibration(CALIBRATION_DIR / f"{name}_bfloat16_kv-bfloat16_nvidia-h200_tp1.yaml")
    term = calibrated_mixed_kv(cal)
    # recorded with the mixed profiles (2026-12-04): 0.11 ns (135M) and 1.3 ns (1B) per token
    assert term is not None and 0.0 < term < 1e-8
    assert cal.feature_max[TERM] > 1_000_000
    assert MIXED.mixed_decode_kv_tokens == 1_000_000
    zero = with_mixed_kv(cal, 0.0).costs.device
    assert cal.costs.device.predict(MIXED) == pytest.approx(zero.predict(MIXED) + term * 1_000_000)
    # an offline fit replaces it, and is then not a calibrated term
    assert calibrated_mixed_kv(with_mixed_kv(cal, MIXED_KV, "offline.json")) is None


def test_a_file_without_the_mixed_profiles_has_no_term():
    path = CALIBRATION_DIR / "smollm2-135m_bfloat16_kv-float8_e4m3fn_nvidia-h200_tp1.yaml"
    cal = load_calibration(path)
    assert TERM not in cal.costs.device.to_dict() and calibrated_mixed_kv(cal) is None
    zero = with_mixed_kv(cal, 0.0).costs.device
    assert cal.costs.device.predict(MIXED) == pytest.approx(zero.predict(MIXED))
    assert calibrated_mixed_kv(with_mixed_kv(cal, MIXED_KV, "offline.json")) is None
