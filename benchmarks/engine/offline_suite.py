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


def run(model: str, backend: str, n: int, extra: list[str] | None = None) -> list[str]:
    """The benchmark workload (docs/benchmarks.md, Conventions) on the shapes of
    configs/engine/h200-throughput.yaml (shared compile cache)."""
    return [
        "--config",
        "h200-throughput",
        "--model",
        model,
        "--attention-backend",
        backend,
        *PERF,
        "--num-prompts",
        str(n),
        "--warmup-requests",
        "16",
        *(extra or []),
    ]


# Issue 7's experiments, all on SmolLM2-135M with the Pallas kernel. RATE is replaced by a Poisson
# rate derived from the pallas offline run of the same call (see --rate).
SHARED = ["--shared-prefix-len", "1024"]
LONG_MIX = ["--long-prompts", "6", "--long-len", "6000", "--request-rate", "RATE"]
# A pool of 2,000 pages (128k tokens) makes KV capacity the limit for 256 sequences.
SMALL_POOL = ["--num-pages", "2001"]

SUITES: dict[str, dict[str, list[str]]] = {
    # Issue 2: the honest starting point with the jnp reference attention.
    "baseline": {
        "smollm2-135m/reference": run("smollm2-135m", "reference", 200),
        "llama3.2-1b/reference": run("llama3.2-1b", "reference", 200),
    },
    # Issue 4: the Pallas kernel against the reference, same workload, same run.
    "pallas": {
        "smollm2-135m/pallas": run("smollm2-135m", "pallas", 200),
        "smollm2-135m/reference": run("smollm2-135m", "reference", 200),
        "llama3.2-1b/pallas": run("llama3.2-1b", "pallas", 200),
        "llama3.2-1b/reference": run("llama3.2-1b", "reference", 200),
    },
    "pallas-smollm2": {
        "smollm2-135m/pallas": run("smollm2-135m", "pallas", 200),
        "smollm2-135m/reference": run("smollm2-135m", "reference", 200),
    },
    # The reference is slow enough that a device call affords it fewer requests: the pallas run
    # is repeated with the reference's count, so one pair compares the same workload.
    "pallas-llama": {
        "llama3.2-1b/pallas": run("llama3.2-1b", "pallas", 200),
        "llama3.2-1b/reference": run("llama3.2-1b", "reference", 60),
        "llama3.2-1b/pallas-60": run("llama3.2-1b", "pallas", 60),
    },
    # Issue 7: prefix caching, isolation, KV capacity.
    "scheduling": {
        "shared-prefix/cache-on": run("smollm2-135m", "pallas", 100, SHARED),
        "shared-prefix/cache-off": run(
            "smollm2-135m", "pallas", 100, SHARED + ["--no-prefix-caching"]
        ),
        "long-mix/isolated": run(
            "smollm2-135m", "pallas", 100, LONG_MIX + ["--long-prefill-threshold", "2048"]
        ),
        "long-mix/not-isolated": run("smollm2-135m", "pallas", 100, LONG_MIX),
        # A budget above every prompt: each prefill runs whole in one step (no chunking).
        "long-mix/unchunked": run(
            "smollm2-135m", "pallas", 100, LONG_MIX + ["--max-num-batched-tokens", "8192"]
        ),
        "kv/80pct": run("smollm2-135m", "pallas", 150, SMALL_POOL + ["--kv-headroom", "0.2"]),
        "kv/100pct": run("smollm2-135m", "pallas", 150, SMALL_POOL + ["--kv-headroom", "0"]),
    },
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("suite", choices=sorted(SUITES))
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--only", default=None, help="comma-separated run names")
    ap.add_argument(
        "--num-prompts", default=None, help="override the runs' prompt counts: N, or name=N,name=N"
    )
    ap.add_argument(
        "--rate",
        type=float,
        default=None,
        help="Poisson rate for RATE placeholders; default: half the req/s of a pallas "
        "offline result in --out",
    )
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, NORI_JAX_CACHE_DIR=os.environ.get("NORI_JAX_CACHE_DIR", "/tmp/nori_xla"))
    rows = []
    rate = args.rate
    if rate is None:
        done = sorted(out.glob("smollm2-135m_pallas.json"))
        rate = 0.5 * json.loads(done[0].read_text())["request_throughput"] if done else 4.0
    for name, flags in SUITES[args.suite].items():
        flags = [f"{rate:.2f}" if f == "RATE" else f for f in flags]
        if args.num_prompts:
            counts = dict(kv.split("=") for kv in args.num_prompts.split(",") if "=" in kv)
            n = counts.get(name, None if counts else args.num_prompts)
            if n is not None:
                flags[flags.index("--num-prompts") + 1] = str(n)
        if args.only and name not in args.only.split(","):
            continue
        tag = name.replace("/", "_")
        cmd = [
            sys.executable,
            "-m",
            "nori_jax.cli",
            "--log-level",
            "INFO",
            "bench",
            "offline",
            *flags,
            "--result-json",
            str(out / f"{tag}.json"),
        ]
        print("$", " ".join(cmd[1:]), flush=True)
        t = time.time()
        with open(out / f"{tag}.log", "w") as log:
            try:
                rc = subprocess.run(
                    cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=args.timeout
                ).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        print(f"  {name}: rc={rc} in {time.time() - t:.0f}s", flush=True)
        if rc == 0:
            r = json.loads((out / f"{tag}.json").read_text())
            rows.append((name, r))
        else:
            print((out / f"{tag}.log").read_text()[-3000:])
    print(
        f"\n{'run':<26}{'total tok/s':>12}{'out tok/s':>10}{'req/s':>7}{'step ms':>8}"
        f"{'tok/step':>9}{'sched%':>7}{'launch%':>8}{'wait%':>6}{'post%':>6}{'preempt':>8}"
        f"{'hit%':>5}{'TTFT p50/p99 short (ms)':>25}"
    )
    for name, r in rows:
        e = r["elapsed_s"]
        ttft = r["latency_ms"].get("ttft_short") or {}
        print(
            f"{name:<26}{r['total_token_throughput']:>12.0f}{r['output_throughput']:>10.0f}"
            f"{r['request_throughput']:>7.2f}{r['mean_step_ms']:>8.2f}{r['mean_tokens_per_step']:>9.0f}"
            f"{100 * r['schedule_s'] / e:>7.1f}{100 * r['launch_s'] / e:>8.1f}"
            f"{100 * r['wait_s'] / e:>6.1f}{100 * r['postprocess_s'] / e:>6.1f}"
            f"{r['num_preemptions']:>8}{100 * r['prefix_cache_hit_rate']:>5.0f}"
            f"{ttft.get('p50', 0):>13.0f} / {ttft.get('p99', 0):<9.0f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
