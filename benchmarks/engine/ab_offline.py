"""A/B of `nori-jax bench offline` between source trees, in one process group, alternating.

    python benchmarks/engine/ab_offline.py --tree base=.ab/base --tree new=. --rounds 2 \
        --out $OUT -- --config h200-throughput --max-num-seqs 1024 \
        --max-num-batched-tokens 8192 --num-prompts 2000

Runs the trees A B A B ... (the GPU machine's host drifts 15-30% between calls, so only rows of
one call compare), each in a fresh process with the tree first on PYTHONPATH and its own
compilation cache (warm from the second round on; `--cache-dir` gives them one, which is sound:
XLA's cache is keyed by the program, and it spares each tree its cold first run when the trees
differ on the host side only). `--env NAME:KEY=VALUE` sets a variable for one tree's runs, so
one tree can run twice under two settings (`--tree on=. --tree off=. --env off:X=0`), and
`--tree-args NAME:ARGS` adds bench flags to one tree's runs (`--tree-args "pils:--attention-tuning
'tokens<2048: prefill_interleave=per_step'"`, split as a shell would). Prints one
table row per run: total and output tok/s, steps, and the engine's stage split; writes each run's
JSON and log under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path


def run_one(
    name: str,
    tree: Path,
    bench_args: list[str],
    out: Path,
    r: int,
    timeout: float,
    cache_dir: str | None = None,
    extra_env: dict[str, str] | None = None,
    extra_args: list[str] | None = None,
):
    out = out.resolve()
    result = out / f"{name}_{r}.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{tree.resolve()}:{env.get('PYTHONPATH', '')}"
    env["NORI_JAX_CACHE_DIR"] = cache_dir or f"/tmp/nori_xla_{name}"
    env.update(extra_env or {})
    env["PYTHONUNBUFFERED"] = "1"
    cmd = [sys.executable, "-m", "nori_jax.cli", "bench", "offline", *bench_args]
    cmd += extra_args or []
    cmd += ["--result-json", str(result)]
    t0 = time.perf_counter()
    with (out / f"{name}_{r}.log").open("w") as log:
        # cwd is the tree: `python -m` puts the working directory ahead of PYTHONPATH.
        proc = subprocess.run(
            cmd, env=env, cwd=tree, stdout=log, stderr=subprocess.STDOUT, timeout=timeout
        )
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or not result.is_file():
        tail = (out / f"{name}_{r}.log").read_text()[-1500:]
        return {"name": name, "round": r, "error": f"exit {proc.returncode}", "tail": tail}
    data = json.loads(result.read_text())
    data.update(name=name, round=r, wall_s=wall)
    return data


def row(d: dict) -> str:
    if "error" in d:
        return f"{d['name']:<8}{d['round']:>3}  ERROR {d['error']}\n{d['tail']}"
    e = d["elapsed_s"]
    split = "/".join(f"{100 * d[k] / e:.0f}" for k in ("schedule_s", "launch_s", "wait_s"))
    split += f"/{100 * d['postprocess_s'] / e:.0f}"
    return (
        f"{d['name']:<8}{d['round']:>3}{d['total_token_throughput']:>11,.0f}"
        f"{d['output_throughput']:>10,.0f}{d['steps']:>7}{d['mean_step_ms']:>8.2f}"
        f"{split:>16}{d.get('num_recompiles', 0):>5}{d['wall_s']:>7.0f}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", action="append", required=True, help="NAME=PATH of a source tree")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default="/tmp/ab_offline")
    p.add_argument("--timeout", type=float, default=400, help="seconds per run")
    p.add_argument("--cache-dir", help="one compilation cache for every tree (default: one each)")
    p.add_argument("--env", action="append", default=[], help="NAME:KEY=VALUE for tree NAME")
    p.add_argument(
        "--tree-args", action="append", default=[], help="NAME:ARGS, bench flags for tree NAME"
    )
    args, bench_args = p.parse_known_args()
    if bench_args and bench_args[0] == "--":
        bench_args = bench_args[1:]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    trees = [t.split("=", 1) for t in args.tree]
    envs: dict[str, dict[str, str]] = {}
    for item in args.env:
        name, _, assignment = item.partition(":")
        key, sep, value = assignment.partition("=")
        if not sep or name not in dict(trees):
            p.error(f"--env {item!r}: expected NAME:KEY=VALUE for a --tree NAME")
        envs.setdefault(name, {})[key] = value
    tree_args: dict[str, list[str]] = {}
    for item in args.tree_args:
        name, sep, flags = item.partition(":")
        if not sep or name not in dict(trees):
            p.error(f"--tree-args {item!r}: expected NAME:ARGS for a --tree NAME")
        tree_args.setdefault(name, []).extend(shlex.split(flags))
    rows = []
    header = f"{'tree':<8}{'rnd':>3}{'total/s':>11}{'out/s':>10}{'steps':>7}{'ms/st':>8}"
    header += f"{'sch/lau/wai/pp%':>16}{'rec':>5}{'wall':>7}"
    for r in range(args.rounds):
        for name, path in trees:
            d = run_one(
                name,
                Path(path),
                bench_args,
                out,
                r,
                args.timeout,
                args.cache_dir,
                envs.get(name),
                tree_args.get(name),
            )
            rows.append(d)
            print(row(d), flush=True)
    (out / "ab_offline.json").write_text(json.dumps(rows, indent=1))
    print(header)
    for d in rows:
        print(row(d))


if __name__ == "__main__":
    main()
