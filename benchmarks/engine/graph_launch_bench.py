"""What launching a CUDA graph costs the host when the buffers of its kernels move between calls.

    python benchmarks/engine/graph_launch_bench.py [--kernels 400] [--calls 200] [--json F]

XLA runs a compiled program as one CUDA graph (a command buffer). A node whose buffer moved since
the last launch must be updated before the graph runs again. The step buffer of the engine is a
fresh device array every step, and dozens of the forward pass's kernels read it (every layer's KV
write and attention). This measures what that costs, on a chain of `--kernels` small matmuls (one
kernel each), called `--calls` times back to back (host microseconds per call, no waiting):

  moved-all    every kernel reads a slice of an input that is a fresh array on each call
  moved-edges  a fresh input read by the first kernel only; a fresh output from the last one
  stable       the same input arrays on every call and the output written into a donated buffer
               (aliased), so no buffer moves

(On the H200, 2026-12-04, call P3: 1,894 / 1,866 / 787 us for 400 kernels. One moved buffer costs
what all do, which is why the runner keeps every buffer of the forward pass in place.)

Each program runs under the update mode the engine uses (`skip_temp`) unless `--update` names
another: `always` (XLA's default) or `skip_profiled` (XLA watches which buffers of the graph move
during the first launches, then maps those at fixed virtual addresses; with jax 0.11.2 a moved
buffer still costs the whole update: docs/benchmarks.md, "Host costs").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kernels", type=int, default=400)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--update", default="skip_temp", choices=("skip_temp", "skip_profiled", "always")
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=3,
        help="untimed calls first (compile, record the graph; skip_profiled watches the first "
        "calls' addresses before it remaps the buffers that moved)",
    )
    p.add_argument("--json", default=None)
    args = p.parse_args()

    from nori_jax.executor import xla_flags

    flags = os.environ.get("XLA_FLAGS", "")
    if args.update == "skip_profiled":  # XLA's, not an engine mode (docs/benchmarks.md)
        os.environ["XLA_FLAGS"] = xla_flags.with_update_value(flags, "SKIP_PROFILED")
    else:
        os.environ["XLA_FLAGS"] = xla_flags.with_update_mode(flags, args.update)
    import jax
    import jax.numpy as jnp
    import numpy as np

    h, n_w, k = 128, 30, args.kernels
    rng = np.random.default_rng(0)
    ws = [jnp.asarray(rng.standard_normal((h, h)) / h**0.5, jnp.bfloat16) for _ in range(n_w)]
    x0 = jnp.asarray(rng.standard_normal((16, h)), jnp.bfloat16)
    side0 = jnp.asarray(rng.standard_normal((k, h)) * 0.01, jnp.bfloat16)

    def chain(x, side, ws):
        for i in range(k):
            x = jnp.tanh(x @ ws[i % n_w] + side[i])
        return x

    programs = {
        "moved-all": jax.jit(lambda x, side, ws: chain(x, side, ws)),
        "moved-edges": jax.jit(lambda x, side, ws: chain(x, side, ws)),
        "stable": jax.jit(
            lambda x, side, ws, out: chain(x + 0.0 * out, side, ws), donate_argnums=3
        ),
    }
    fresh_x = [x0 + i for i in range(args.calls)]
    fresh_side = [side0 * (1 + 1e-3 * i) for i in range(args.calls)]
    jax.block_until_ready((fresh_x, fresh_side))

    def run(name):
        f = programs[name]
        out = jnp.zeros_like(x0)
        f_args = {
            "moved-all": lambda i: (x0, fresh_side[i], ws),
            "moved-edges": lambda i: (fresh_x[i], side0, ws),
            "stable": lambda i: (x0, side0, ws, out),
        }[name]
        for i in range(args.warmup):  # compile, record the graph
            r = f(*f_args(i % args.calls))
            if name == "stable":
                out = r
        jax.block_until_ready(r)
        t0 = time.perf_counter()
        for i in range(args.calls):
            r = f(*f_args(i))
            if name == "stable":
                out = r
        host = (time.perf_counter() - t0) / args.calls
        jax.block_until_ready(r)
        wall = (time.perf_counter() - t0) / args.calls
        return host * 1e6, wall * 1e6

    results = {name: [] for name in programs}
    for _ in range(args.rounds):
        for name in programs:
            results[name].append(run(name))
    kind = jax.devices()[0].device_kind
    print(f"{kind}, {k} kernels, update {args.update}: host / wall us per call")
    summary = {}
    for name, rs in results.items():
        host = statistics.median(r[0] for r in rs)
        wall = statistics.median(r[1] for r in rs)
        summary[name] = {"host_us": host, "wall_us": wall, "runs": rs}
        print(f"  {name:13s} {host:8.1f} {wall:8.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"kernels": k, "update": args.update, "results": summary}, f, indent=1)


if __name__ == "__main__":
    main()
