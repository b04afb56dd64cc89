"""Derive a step model of the SmolLM2-135M shape on the H200 from docs/benchmarks.md's figures.

    python benchmarks/plan/derive_h200_calibration.py [--out FILE]

Not a calibration: `nori-jax plan calibrate` on the H200 records one (benchmarks/plan/
h200_plan_suite.sh) and its file replaces this one (same name). Until then this file lets the
planner run for that shape, flagged `derived: true` (the planner warns on every use). Every
number below is a figure of docs/benchmarks.md, named where it is used; what the figures do not
give (per-token host costs of prefill, the KV pool, the KV transfer) is left out or estimated,
as said next to it.
"""

from __future__ import annotations

import argparse
import dataclasses

from nori_jax.plan.calibrate import fit_launch_wait
from nori_jax.plan.calibration import (
    CALIBRATION_DIR,
    CalibratedEngine,
    Calibration,
    CalibrationKey,
    save_calibration,
)
from nori_jax.plan.features import StepFeatures
from nori_jax.plan.step_model import DEVICE_TERMS, HOST_TERMS, LinearModel, StepCosts
from nori_jax.plan.virtual_device import loop_seconds

LAYERS, KV_HEADS, HEAD_DIM, BF16 = 30, 3, 64, 2  # configs/models/smollm2-135m.yaml
# "Host costs" table, the rows of the bdc6e5f call (2026-12-01; h200-throughput, 1,024
# sequences / 8,192 tokens per step, page 64, every sequence decoding after a 1,024-token
# prompt): (rows, wall, schedule + plan, launch = transfer + forward + sampler, post-process,
# device busy), milliseconds per step.
PROFILES = (
    (64, 4.44, 0.61, 0.42 + 2.25 + 0.30, 0.26, 1.80),
    (1024, 13.60, 1.24, 0.47 + 3.25 + 0.38, 0.89, 8.67),
)
ATTENTION_1024_MS = 6.81  # the same row: the attention kernels' share of the device time
# step_profile.py times 30 steps after 5 settling ones, then traces 30 more: the rows' KV
# length during the trace is about 1,024 + 5 + 30 + 15.
TRACED_CONTEXT = 1074
# "Prefill kernel" tables, 9q/3kv/64, kernel time per layer call: an 8,192-token chunk from
# position 0 (176 us) and a 2,048-token chunk after 6,144 cached tokens (0.079 ms).
PREFILL_KERNEL = ((8192, 0, 176e-6), (2048, 6144, 79e-6))


def pairs(q: int, start: int) -> int:
    return q * start + q * (q + 1) // 2


def derive() -> Calibration:
    (r1, _, s1, l1, p1, d1), (r2, _, s2, l2, p2, d2) = PROFILES
    per_kv = ATTENTION_1024_MS / 1e3 / (r2 * TRACED_CONTEXT)
    rest1 = d1 / 1e3 - per_kv * r1 * TRACED_CONTEXT  # device time besides decode attention
    rest2 = (d2 - ATTENTION_1024_MS) / 1e3
    per_bucket = (rest2 - rest1) / (r2 - r1)  # decode rows = bucket in these steps
    step = rest1 - per_bucket * r1
    per_pair = sum(LAYERS * t / pairs(q, s) for q, s, t in PREFILL_KERNEL) / len(PREFILL_KERNEL)
    device = LinearModel(DEVICE_TERMS, (step, per_bucket, per_kv, per_pair, 0.0))

    def host(a: float, b: float) -> LinearModel:  # a at r1 rows, b at r2 rows (ms)
        per_row = (b - a) / 1e3 / (r2 - r1)
        return LinearModel(HOST_TERMS, (a / 1e3 - per_row * r1, per_row, 0.0))

    costs = StepCosts(device, host(s1, s2), host(l1, l2), host(p1, p2))
    steady = [[StepFeatures(r, r, r, r, 0, r * TRACED_CONTEXT, 0)] * 30 for r, *_ in PROFILES]
    walls = [w / 1e3 for _, w, *_ in PROFILES]
    costs = dataclasses.replace(costs, launch_wait=fit_launch_wait(costs, steady, walls, 30))
    check = [
        {
            "shape": f"decode {r} x 1024",
            "measured_ms": w,
            "predicted_ms": 1e3 * loop_seconds(costs, f, overlapped=True) / 30,
        }
        for (r, w, *_), f in zip(PROFILES, steady, strict=True)
    ]
    kv_per_token = LAYERS * 2 * KV_HEADS * HEAD_DIM * BF16
    # The KV pool is not in the figures: estimated as the engine sizes it (0.9 of the memory
    # JAX's allocator hands out, 75% of the 143,771 MiB by default, less the weights).
    pool_bytes = 0.9 * 0.75 * 143_771 * 2**20 - 135e6 * BF16
    engine = CalibratedEngine(
        page_size=64,
        num_pages=int(pool_bytes // (64 * kv_per_token)) + 1,
        max_model_len=8192,
        max_num_seqs=1024,
        max_num_batched_tokens=8192,
        vocab_size=49152,
        kv_bytes_per_token=kv_per_token,
        attention_backend="pallas",
        async_scheduling=True,
    )
    feature_max = {  # what the figures cover; beyond it the planner warns
        "bucket": 1024.0,
        "num_rows": 1024.0,
        "num_decodes": 1024.0,
        "decode_kv_tokens": 1024.0 * TRACED_CONTEXT,
        "prefill_pairs": float(pairs(8192, 0)),
    }
    source = (
        "derived from docs/benchmarks.md (Host costs: the two bdc6e5f step profiles at 64 and "
        "1,024 decoding sequences; Prefill kernel: 9q/3kv/64 chunk times) by "
        "benchmarks/plan/derive_h200_calibration.py; not recorded by plan calibrate: no prefill "
        "host costs, no KV transfer, KV pool estimated"
    )
    key = CalibrationKey("smollm2-135m", "bfloat16", "bfloat16", "NVIDIA H200", 1)
    return Calibration(key, engine, costs, feature_max, {}, source, True, None, tuple(check))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cal = derive()
    p.add_argument("--out", default=str(CALIBRATION_DIR / cal.key.filename))
    args = p.parse_args()
    header = (
        f"DERIVED, not measured: {cal.key.describe()}.\n"
        f"{cal.source}.\n"
        "Replace with: nori-jax plan calibrate (see docs/planning.md, benchmarks/plan/)."
    )
    print(save_calibration(cal, args.out, header))
    for c in cal.check:
        print(f"{c['shape']}: {c['measured_ms']:.2f} ms measured, {c['predicted_ms']:.2f} replayed")
    print(f"launch_wait {cal.costs.launch_wait:.2f}")


if __name__ == "__main__":
    main()
