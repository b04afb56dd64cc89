"""The logprob programs' top-k forms (nori_jax/executor/top_k.py) on the GPU: device time per
call in a stream, each form checked against `lax.top_k`.

    PYTHONPATH=. python benchmarks/kernels/top_k_bench.py [--rows 16,256,1024]
        [--vocab 49152,128256] [--k 5,16,20] [--out DIR]

Times each form on float32 [rows, vocab] log-softmaxed rows, with the log-softmax alone as the
floor (every form reads it); prints one line per case and writes the rows as JSON lines.
"""

from __future__ import annotations

import argparse
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from stream_timing import time_stream

from nori_jax.executor.top_k import FORMS, top_k


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="16,256,1024")
    p.add_argument("--vocab", default="49152,128256")
    p.add_argument("--k", default="5,16,20")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    ints = lambda s: [int(v) for v in s.split(",") if v]  # noqa: E731
    results = []
    print(f"{'rows':>6}{'vocab':>8}{'k':>4}  {'form':<8}{'us':>9}  exact")
    for vocab in ints(args.vocab):
        for rows in ints(args.rows):
            logits = jax.random.normal(jax.random.key(rows), (rows, vocab), jnp.float32) * 4
            floor = jax.jit(lambda x: jax.nn.log_softmax(x, axis=-1).max(axis=-1))
            base_us = 1e6 * time_stream(floor, logits)
            print(f"{rows:>6}{vocab:>8}{'':>4}  {'softmax':<8}{base_us:9.1f}")
            results.append(dict(rows=rows, vocab=vocab, form="log_softmax", us=base_us))
            for k in ints(args.k):
                want = jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), k)
                for form in FORMS:
                    if k <= 16 and form != "xla":
                        continue  # every form is lax.top_k there
                    fn = jax.jit(
                        functools.partial(
                            lambda x, k, form: top_k(jax.nn.log_softmax(x, axis=-1), k, form),
                            k=k,
                            form=form,
                        )
                    )
                    got = fn(logits)
                    exact = bool(
                        np.array_equal(np.asarray(got[1]), np.asarray(want[1]))
                        and np.array_equal(np.asarray(got[0]), np.asarray(want[0]))
                    )
                    us = 1e6 * time_stream(fn, logits)
                    print(f"{rows:>6}{vocab:>8}{k:>4}  {form:<8}{us:9.1f}  {exact}")
                    results.append(dict(rows=rows, vocab=vocab, k=k, form=form, us=us, exact=exact))
    with open(os.path.join(args.out, "top_k_bench.json"), "w") as f:
        json.dump(dict(device=str(jax.devices()[0]), results=results), f, indent=1)


if __name__ == "__main__":
    main()
