"""Device time of the sampler programs and of the top-k / sort primitives they are built from.

    python benchmarks/engine/sampler_bench.py [--rows 256,1024] [--vocab 49152,128256]
        [--forms sort,auto,search,search_siblings] [--json F]

For each (rows, vocab): the sampler programs on random logits (greedy; random without filters;
top_p=0.95 on 16, 64, ... and all rows, each in its filter bucket, and top_k=50 with top_p=0.95
on all rows, under each filter form of executor/filter_search.py, every other form's tokens
checked against the sort form's, which runs first), plus `lax.top_k` at several k and a
full-vocabulary sort, each timed in a stream of calls with one wait (stream_timing.py: a wait
after each call lets the GPU's clock drop between calls, which overstates short programs;
`--per-call` times them that way for comparison). This is the evidence behind
sampling_modes.py's choice of filtering only the filtering rows, and behind filter_search.py's
`auto` table.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from nori_jax.core.sampling_modes import GREEDY, RANDOM, choose_program, filter_buckets
from nori_jax.executor.filter_search import FORMS as FILTER_FORMS
from nori_jax.executor.sampler import sample

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
from stream_timing import time_each_call, time_stream  # noqa: E402


def timed(fn, *args, iters: int, per_call: bool) -> float:
    """ms per call: a stream of `iters` calls (median of 5), or one call at a time (--per-call)."""
    timer = time_each_call if per_call else time_stream
    return 1e3 * timer(fn, *args, calls=iters)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="256,1024")
    p.add_argument("--vocab", default="49152,128256")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--json", default=None)
    p.add_argument("--per-call", action="store_true", help="a wait after each call (the old way)")
    p.add_argument("--forms", default=",".join(FILTER_FORMS), help="filter forms to time")
    args = p.parse_args()
    results = []
    print(f"{'rows':>6}{'vocab':>8}  {'what':<38}{'ms':>9}  tokens against sort")
    for s in map(int, args.rows.split(",")):
        for v in map(int, args.vocab.split(",")):
            logits = jax.random.normal(jax.random.key(0), (s, v), jnp.float32) * 3
            seeds = jnp.arange(s, dtype=jnp.int32)
            idx = jnp.zeros(s, jnp.int32)
            forms = sorted(args.forms.split(","), key=lambda f: f != "sort")  # the reference first
            cases = [("greedy", 0.0, 0, 0, "sort"), ("random, no filter", 0.8, 0, 0, "sort")]
            for form in forms:
                cases += [
                    (f"top_p=0.95 on {n} rows, {form}", 0.8, n, 0, form) for n in filter_buckets(s)
                ]
                cases.append((f"top_k=50 top_p=0.95, {form}", 0.8, s, 50, form))
            reference = {}
            for what, t, n_filtered, k, form in cases:
                top_p = np.ones(s, np.float32)
                top_p[:n_filtered] = 0.95
                top_k = np.zeros(s, np.int32)
                top_k[:n_filtered] = k
                temperature = np.full(s, t, np.float32)
                program, rows = choose_program(temperature, top_p, top_k, s)
                assert program in (GREEDY, RANDOM) or program.filter_rows == n_filtered
                filter_rows = np.full(s, s, np.int32)
                filter_rows[: len(rows)] = rows
                os.environ["NORI_JAX_FILTER"] = form  # read while tracing: one jit per form
                fn = jax.jit(functools.partial(sample, program=program))
                call = (
                    logits,
                    jnp.asarray(temperature),
                    jnp.asarray(top_p),
                    jnp.asarray(top_k),
                    jnp.zeros(s, jnp.float32),  # min_p off
                    seeds,
                    idx,
                    jnp.asarray(filter_rows),
                )
                tokens = np.asarray(fn(*call)[0])
                same = what.replace(form, "sort")
                if form == "sort":
                    reference[what] = tokens
                    exact = ""
                elif same in reference:
                    exact = "exact" if np.array_equal(tokens, reference[same]) else "DIFFERS"
                else:
                    exact = "unchecked"
                ms = timed(fn, *call, iters=args.iters, per_call=args.per_call)
                results.append({"rows": s, "vocab": v, "what": what, "ms": ms, "tokens": exact})
            for k in (k for k in (16, 64, 256, 1024) if k <= v):
                fn = jax.jit(lambda x, k=k: jax.lax.top_k(x, k))
                results.append(
                    {
                        "rows": s,
                        "vocab": v,
                        "what": f"lax.top_k k={k}",
                        "ms": timed(fn, logits, iters=args.iters, per_call=args.per_call),
                    }
                )
            fn = jax.jit(lambda x: jnp.sort(x, axis=-1))
            results.append(
                {
                    "rows": s,
                    "vocab": v,
                    "what": "full sort",
                    "ms": timed(fn, logits, iters=args.iters, per_call=args.per_call),
                }
            )
            fn = jax.jit(lambda x: jnp.argmax(x, axis=-1))
            results.append(
                {
                    "rows": s,
                    "vocab": v,
                    "what": "argmax (one read)",
                    "ms": timed(fn, logits, iters=args.iters, per_call=args.per_call),
                }
            )
            for r in results:
                if r["rows"] == s and r["vocab"] == v:
                    print(f"{s:>6}{v:>8}  {r['what']:<38}{r['ms']:>9.3f}  {r.get('tokens', '')}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
