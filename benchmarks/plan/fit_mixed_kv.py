"""Fit a calibration's mixed-step device term to a `bench offline` run of the same shape and
engine (nori_jax/plan/offline_fit.py), and write the calibration with it:

    python benchmarks/plan/fit_mixed_kv.py CAL.yaml offline_MODEL.json --out CAL_mixed.yaml

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
from nori_jax.plan.offline_fit import fit_mixed_kv, offline_tpot, replay_offline, with_mixed_kv


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("calibration")
    p.add_argument("offline_json", help="bench offline --result-json of the same engine")
    p.add_argument("--out", required=True, help="calibration YAML to write")
    args = p.parse_args()
    try:
        cal = load_calibration(args.calibration)
        tpot_ms, steps, n = offline_tpot(json.loads(Path(args.offline_json).read_text()))
        shaping = OfflineConfig(WorkloadConfig(num_prompts=n))
        fit = fit_mixed_kv(cal, replay_offline(shaping), tpot_ms, measured_steps=steps)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    note = f"{Path(args.offline_json).name} (TPOT P50 {tpot_ms:.2f} ms, {steps} steps)"
    out = with_mixed_kv(cal, fit.seconds_per_token, note)
    header = (
        f"{cal.key.describe()}: {args.calibration}\n"
        f"with the mixed-step device term fitted to {note} (benchmarks/plan/fit_mixed_kv.py)"
    )
    save_calibration(out, args.out, header)
    print(
        f"{cal.key.model}: mixed_decode_kv_tokens {fit.seconds_per_token:.3g} s per KV token; "
        f"offline TPOT P50 measured {fit.measured_tpot_ms:.2f} ms, replayed "
        f"{fit.without_term_ms:.2f} without the term, {fit.simulated_tpot_ms:.2f} with it "
        f"({fit.steps} steps); wrote {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
