"""Fit a calibration's mixed-step device term to a `bench offline` run of the same shape and
engine (nori_jax/plan/offline_fit.py), and write the calibration with the term to use:

    python benchmarks/plan/fit_mixed_kv.py CAL.yaml offline_MODEL.json --out CAL_mixed.yaml

Where `plan calibrate` fitted the term itself (files recorded since it profiles mixed steps at
size), the calibrated term wins: the file is written with it unchanged, and the offline fit and
the replay's TPOT with each term are printed beside it as the cross-check (`--replace` writes
the offline fit instead). Files without a calibrated term get the offline fit, as before.

The offline run must be `bench offline`'s default lognormal workload with the engine the
calibration was recorded with (h200_plan_suite.sh's `offline` part: --num-prompts 2,000); its
step count is checked against the replay's. Best from the same device call as the calibration:
the host drifts 15-30% between calls.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from nori_jax.bench.offline import OfflineConfig
from nori_jax.bench.workload import WorkloadConfig
from nori_jax.plan.calibration import load_calibration, save_calibration
from nori_jax.plan.offline_fit import (
    calibrated_mixed_kv,
    fit_mixed_kv,
    offline_tpot,
    replay_offline,
    with_mixed_kv,
)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("calibration")
    p.add_argument("offline_json", help="bench offline --result-json of the same engine")
    p.add_argument("--out", required=True, help="calibration YAML to write")
    p.add_argument(
        "--replace",
        action="store_true",
        help="write the offline fit even where the calibration has a calibrated term",
    )
    args = p.parse_args()
    try:
        cal = load_calibration(args.calibration)
        tpot_ms, steps, n = offline_tpot(json.loads(Path(args.offline_json).read_text()))
        run = replay_offline(OfflineConfig(WorkloadConfig(num_prompts=n)))
        fit = fit_mixed_kv(cal, run, tpot_ms, measured_steps=steps)
        calibrated = calibrated_mixed_kv(cal)
        calibrated_ms = run(cal)[0] if calibrated is not None else None
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    note = f"{Path(args.offline_json).name} (TPOT P50 {tpot_ms:.2f} ms, {steps} steps)"
    offline = (
        f"offline fit {fit.seconds_per_token:.3g} s per KV token; offline TPOT P50 measured "
        f"{fit.measured_tpot_ms:.2f} ms, replayed {fit.without_term_ms:.2f} without the term, "
        f"{fit.simulated_tpot_ms:.2f} with the offline fit"
    )
    if calibrated is not None and not args.replace:
        out = cal
        header = (
            f"{cal.key.describe()}: {args.calibration}, its calibrated mixed-step term kept\n"
            f"cross-check against {note}: {offline}"
        )
        used = (
            f"mixed_decode_kv_tokens {calibrated:.3g} s per KV token calibrated (used), replayed "
            f"{calibrated_ms:.2f} ms ({calibrated_ms / tpot_ms - 1:+.1%}); {offline}"
        )
    else:
        out = with_mixed_kv(cal, fit.seconds_per_token, note)
        header = (
            f"{cal.key.describe()}: {args.calibration}\n"
            f"with the mixed-step device term fitted to {note} (benchmarks/plan/fit_mixed_kv.py)"
        )
        was = "" if calibrated is None else f", replacing the calibrated {calibrated:.3g}"
        used = f"mixed_decode_kv_tokens from the {offline} (used{was})"
    save_calibration(out, args.out, header)
    print(f"{cal.key.model}: {used} ({fit.steps} steps); wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
