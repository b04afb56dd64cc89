"""`plan calibrate` on the CPU engine (tiny-cpu preset, a handful of shapes): the profiles hold
the shapes asked for, the file loads, and the simulator runs on it. The fitted numbers are CPU
timings and are not asserted (speed is measured, never asserted by tests)."""

from __future__ import annotations

import math

import pytest

from nori_jax.bench.offline import OfflineConfig
from nori_jax.bench.workload import WorkloadConfig
from nori_jax.engine_config import EngineConfig
from nori_jax.plan.calibrate import ProfileGrid, calibrate, mixed_report, write
from nori_jax.plan.calibration import CalibrationQuery, find_calibration, load_calibration
from nori_jax.plan.offline_fit import TERM, calibrated_mixed_kv
from nori_jax.plan.planner import Planner, PlanSettings

# Mixed batches, at both contexts: 4 with the grid's 4 decoders, then 2 of them (2 let go);
# 8 (max_num_seqs) as 7 of the grid's 8 (the prompt needs a slot).
GRID = ProfileGrid(
    batches=(1, 4, 8),
    contexts=(16, 48),
    prefill_lens=(40, 150),
    mixed_batches=(2, 4, 8),
    steps=3,
)
MIXED_SHAPES = {(b, c) for b in (2, 4, 7) for c in (16, 48)}


@pytest.fixture(scope="module")
def calibrated():
    config = EngineConfig.from_yaml("tiny-cpu", max_num_seqs=8, max_num_batched_tokens=64)
    return calibrate(config, GRID, log=lambda _: None)


def test_profiles_hold_the_requested_shapes(calibrated):
    cal, profiles = calibrated
    decode = [p for p in profiles if p.phase == "decode"]
    assert len(decode) == len(GRID.batches) * len(GRID.contexts) * GRID.steps
    shapes = set()
    for p in decode:
        f = p.features
        assert f.prefill_tokens == 0 and f.num_decodes == f.num_rows
        # Every row decodes at its context plus the tokens generated so far.
        context = next(c for c in GRID.contexts if f.decode_kv_tokens <= f.num_rows * (c + 12))
        assert f.decode_kv_tokens >= f.num_rows * (context + 1)
        shapes.add((f.num_rows, context))
    assert shapes == {(b, c) for b in GRID.batches for c in GRID.contexts}
    # The 150-token prompt runs as chunks of the 64-token budget: 64, 64, 22, the later ones
    # attending to what the earlier wrote.
    pairs = {p.features.prefill_pairs for p in profiles if p.phase == "prefill"}
    assert 64 * 128 - 64 * 63 // 2 in pairs
    assert any(p.features.prefill_tokens and p.features.num_decodes for p in profiles)  # mixed
    for p in profiles:
        assert min(p.schedule_s, p.launch_s, p.device_s, p.postprocess_s) >= 0


def test_the_mixed_profiles_run_each_batch_beside_the_prompts(calibrated):
    cal, profiles = calibrated
    mixed = [p for p in profiles if p.phase == "mixed"]
    assert {p.shape for p in mixed} == {f"mixed {b} x {c}" for b, c in MIXED_SHAPES}
    for batch, context in MIXED_SHAPES:
        steps = [p.features for p in mixed if p.shape == f"mixed {batch} x {context}"]
        chunks = [f for f in steps if f.prefill_tokens]
        # Each prompt's chunks (40: one; 150: three of what the decoders leave of 64 tokens),
        # every one beside all the decoders, which read at least their context each.
        assert len(chunks) == 1 + -(-150 // (64 - batch))
        assert {f.prefill_tokens for f in chunks} >= {40}
        for f in chunks:
            assert f.num_decodes == batch and f.num_rows == batch + 1
            assert f.mixed_decode_kv_tokens == f.decode_kv_tokens >= batch * (context + 1)
    report = {m["shape"]: m for m in mixed_report(cal.costs, profiles)}
    assert set(report) == {f"mixed {b} x {c}" for b, c in MIXED_SHAPES}
    assert all(
        m["measured_ms"] > 0 and m["predicted_ms"] >= m["term_ms"] >= 0 for m in report.values()
    )


def test_the_fit_gives_the_mixed_step_term_from_the_profiles(calibrated, tmp_path):
    cal, profiles = calibrated
    device = cal.costs.device.to_dict()
    assert TERM in device and device[TERM] >= 0  # CPU timings: its value is not asserted
    top = max(p.features.mixed_decode_kv_tokens for p in profiles)
    assert cal.feature_max[TERM] == top > 0
    for name in ("device_mixed_steps", "device_mixed_steps_no_term"):
        n = sum(1 for p in profiles if p.features.mixed_decode_kv_tokens)
        assert cal.quality[name]["profiles"] == n
    back = load_calibration(write(cal, tmp_path / "cal.yaml"))
    assert back.costs.device.to_dict()[TERM] == pytest.approx(device[TERM], rel=1e-4, abs=1e-15)
    assert calibrated_mixed_kv(back) == back.costs.device.to_dict()[TERM]


def test_the_calibration_file_describes_the_engine_and_loads(calibrated, tmp_path):
    cal, profiles = calibrated
    path = write(cal, tmp_path / "cal.yaml")
    back = load_calibration(path)
    assert back.key.describe() == "model=tiny-llama dtype=float32 kv_dtype=float32 device=cpu tp=1"
    assert find_calibration(CalibrationQuery(model="tiny-llama"), directory=tmp_path).path == str(
        path
    )
    e = back.engine
    assert (e.page_size, e.num_pages, e.max_num_seqs, e.max_num_batched_tokens) == (16, 128, 8, 64)
    assert e.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4  # layers x (K, V) x kv heads x dim x fp32
    assert back.feature_max["num_rows"] == max(p.features.num_rows for p in profiles)
    assert back.quality["device"]["profiles"] == len(profiles)
    assert 0.0 <= back.costs.launch_wait <= 1.0
    assert [c["shape"] for c in back.check] == [
        f"decode {b} x {c}" for c in GRID.contexts for b in GRID.batches
    ]
    assert all(c["measured_ms"] > 0 and c["predicted_ms"] > 0 for c in back.check)
    assert back.kv_transfer.bytes_per_s > 0 and back.kv_transfer.path == "device-host-device"
    assert "plan calibrate" in back.source and not back.derived
    # the served core's send path, measured on this host for 1, 4 and 8 API servers
    assert sorted(back.core_io) == [1, 4, 8]
    for n, io in back.core_io.items():  # the file keeps 5 significant digits
        assert io.enabled and io.step_s == pytest.approx(cal.core_io[n].step_s, rel=1e-4)
        assert io.row_s == pytest.approx(cal.core_io[n].row_s, rel=1e-4)


def test_the_simulator_runs_on_a_fresh_calibration(calibrated):
    cal, _ = calibrated
    w = WorkloadConfig(dataset="fixed", num_prompts=20, input_len=40, output_len=8)
    for rate in (10.0, math.inf):
        out = Planner(cal, PlanSettings(OfflineConfig(w))).run_at(rate)
        assert out.run.metrics["completed"] == 20
        assert out.run.metrics["mean_ttft_ms"] > 0


def test_fp8_pages_are_a_calibration_of_their_own(tmp_path):
    """--kv-cache-dtype fp8: the file's key and KV bytes are the pages', not the model's."""
    config = EngineConfig.from_yaml(
        "tiny-cpu", max_num_seqs=8, max_num_batched_tokens=64, kv_cache_dtype="fp8"
    )
    grid = ProfileGrid(
        batches=(1,), contexts=(16,), prefill_lens=(40,), mixed_batches=(1,), steps=2
    )
    cal, _ = calibrate(config, grid, log=lambda _: None)
    back = load_calibration(write(cal, tmp_path))
    assert back.key.describe() == (
        "model=tiny-llama dtype=float32 kv_dtype=float8_e4m3fn device=cpu tp=1"
    )
    assert back.engine.kv_bytes_per_token == 2 * 2 * 2 * 16 * 1  # one byte per value
    query = CalibrationQuery(model="tiny-llama", kv_dtype="fp8")
    found = find_calibration(query, directory=tmp_path)
    assert found.key == back.key
