"""Run `nori-jax bench offline` over several engine configurations, one subprocess each (a fresh
device memory pool per run, one shared compilation cache), and print a table.

    python benchmarks/engine/offline_suite.py SUITE [--out DIR] [--timeout S]

SUITE names a list in SUITES below. Every run's JSON and log land in --out (default $OUT or /tmp).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

PERF = ["--dataset", "lognormal", "--input-max", "6144", "--output-max", "2048"]
H200 = ["--page-size", "64", "--max-num-seqs", "256", "--max-num-batched-tokens", "4096",
        "--max-model-len", "8192", "--dtype", "bfloat16"]


def run(model: str, backend: str, n: int, extra: list[str] | None = None) -> list[str]:
    return ["--model", model, "--load-format", "dummy", "--attention-backend", backend, *H200, *PERF,
            "--num-prompts", str(n), "--warmup-requests", "16", *(extra or [])]


SUITES: dict[str, dict[str, list[str]]] = {
    # Issue 2: the honest starting point with the jnp reference attention.
    "baseline": {
        "smollm2-135m/reference": run("smollm2-135m", "reference", 200),
        "llama3.2-1b/reference": run("llama3.2-1b", "reference", 200),
    },
    # Issue 4: the Pallas kernel against the reference, same workload, same run.
    "pallas": {
        "smollm2-135m/pallas": run("smollm2-135m", "pallas", 400),
        "smollm2-135m/reference": run("smollm2-135m", "reference", 400),
        "llama3.2-1b/pallas": run("llama3.2-1b", "pallas", 400),
        "llama3.2-1b/reference": run("llama3.2-1b", "reference", 400),
    },
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("suite", choices=sorted(SUITES))
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--only", default=None, help="comma-separated run names")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, NORI_JAX_CACHE_DIR=os.environ.get("NORI_JAX_CACHE_DIR", "/tmp/nori_xla"))
    rows = []
    for name, flags in SUITES[args.suite].items():
        if args.only and name not in args.only.split(","):
            continue
        tag = name.replace("/", "_")
        cmd = [sys.executable, "-m", "nori_jax.cli", "--log-level", "INFO", "bench", "offline", *flags,
               "--result-json", str(out / f"{tag}.json")]
        print("$", " ".join(cmd[1:]), flush=True)
        t = time.time()
        with open(out / f"{tag}.log", "w") as log:
            try:
                rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    timeout=args.timeout).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        print(f"  {name}: rc={rc} in {time.time() - t:.0f}s", flush=True)
        if rc == 0:
            r = json.loads((out / f"{tag}.json").read_text())
            rows.append((name, r))
        else:
            print((out / f"{tag}.log").read_text()[-3000:])
    print(f"\n{'run':<28}{'total tok/s':>12}{'out tok/s':>11}{'req/s':>8}{'step ms':>9}"
          f"{'tok/step':>9}{'sched%':>7}{'launch%':>8}{'wait%':>6}{'post%':>6}{'compile s':>10}")
    for name, r in rows:
        e = r["elapsed_s"]
        print(f"{name:<28}{r['total_token_throughput']:>12.0f}{r['output_throughput']:>11.0f}"
              f"{r['request_throughput']:>8.2f}{r['mean_step_ms']:>9.2f}{r['mean_tokens_per_step']:>9.0f}"
              f"{100 * r['schedule_s'] / e:>7.1f}{100 * r['launch_s'] / e:>8.1f}"
              f"{100 * r['wait_s'] / e:>6.1f}"
              f"{100 * r['postprocess_s'] / e:>6.1f}{r['compile_s']:>10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
