"""Device time of the sampler programs and of the top-k / sort primitives they are built from.

    python benchmarks/engine/sampler_bench.py [--rows 256,1024] [--vocab 49152,128256] [--json F]

For each (rows, vocab): every sampler mode on random logits (GREEDY; SAMPLE with top_k=50 rows;
FULL with top_p=0.95 rows), plus `lax.top_k` at several k and a full-vocabulary sort, timed
with block_until_ready (median of --iters runs after warm-up). The sampler's design
(sampling_modes.py) assumes the capped `lax.top_k` is much cheaper than the sort: this says by how
much on the device at hand.
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from nori_jax.core.sampling_modes import DEFAULT_TOP_K_CAP, SamplerMode
from nori_jax.executor.sampler import sample


def timed(fn, *args, iters: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="256,1024")
    p.add_argument("--vocab", default="49152,128256")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    results = []
    print(f"{'rows':>6}{'vocab':>8}  {'what':<28}{'ms':>9}")
    for s in map(int, args.rows.split(",")):
        for v in map(int, args.vocab.split(",")):
            logits = jax.random.normal(jax.random.key(0), (s, v), jnp.float32) * 3
            ones = jnp.ones(s, jnp.float32)
            seeds = jnp.arange(s, dtype=jnp.int32)
            idx = jnp.zeros(s, jnp.int32)
            cases = {
                "sampler GREEDY": (SamplerMode.GREEDY, 0.0, 1.0, 0),
                "sampler SAMPLE (top_k=50)": (SamplerMode.SAMPLE, 0.8, 1.0, 50),
                "sampler SAMPLE (no filter)": (SamplerMode.SAMPLE, 0.8, 1.0, 0),
                "sampler FULL (top_p=0.95)": (SamplerMode.FULL, 0.8, 0.95, 0),
            }
            for what, (mode, t, top_p, top_k) in cases.items():
                fn = jax.jit(functools.partial(sample, mode=mode))
                ms = timed(
                    fn,
                    logits,
                    ones * t,
                    ones * top_p,
                    jnp.full(s, top_k, jnp.int32),
                    seeds,
                    idx,
                    iters=args.iters,
                )
                results.append({"rows": s, "vocab": v, "what": what, "ms": ms})
            for k in (k for k in (16, 64, DEFAULT_TOP_K_CAP, 1024) if k <= v):
                fn = jax.jit(lambda x, k=k: jax.lax.top_k(x, k))
                results.append(
                    {
                        "rows": s,
                        "vocab": v,
                        "what": f"lax.top_k k={k}",
                        "ms": timed(fn, logits, iters=args.iters),
                    }
                )
            fn = jax.jit(lambda x: jnp.sort(x, axis=-1))
            results.append(
                {
                    "rows": s,
                    "vocab": v,
                    "what": "full sort",
                    "ms": timed(fn, logits, iters=args.iters),
                }
            )
            fn = jax.jit(lambda x: jnp.argmax(x, axis=-1))
            results.append(
                {
                    "rows": s,
                    "vocab": v,
                    "what": "argmax (one read)",
                    "ms": timed(fn, logits, iters=args.iters),
                }
            )
            for r in results:
                if r["rows"] == s and r["vocab"] == v:
                    print(f"{s:>6}{v:>8}  {r['what']:<28}{r['ms']:>9.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
