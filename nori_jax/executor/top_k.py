"""Exact top-k of each row for the k the logprob programs ask (up to 20), without a full sort.

XLA:GPU runs `lax.top_k` with k <= 16 as a kernel of its own and anything larger as a sort of
the whole row: at 1,024 rows of a 49,152-token vocabulary 1.30 ms for k = 16 against 3.9 ms for
k = 64 and 3.7 for a full sort (one H200, docs/benchmarks.md, the sampler's primitives). Top
logprobs take 20 (OpenAI's and vLLM's bound), so every step with such rows sorted them whole.

Two exact forms that never ask for more than 16 at once, with the same result as `lax.top_k`
(values descending, ties by the lower index first):

- `passes`: the best 16, then the best k - 16 of the row with those 16 masked out;
- `chunks`: the best k of each chunk of the row, then the best k of those candidates (every
  member of the row's top k is among its chunk's top k).

On an H100 (`benchmarks/kernels/top_k_bench.py`, docs/benchmarks.md) k = 20 took 2.1-3.0x less
time in passes than `lax.top_k` from 128 rows on (1,024 x 49,152: 3.90 -> 1.61 ms), and chunks won
up to about 4M elements (64 x 49,152: 440 -> 182 us, against passes' 220), so `auto`, the
default, takes chunks up to CHUNKS_MAX_ELEMENTS and passes above. `NORI_JAX_TOP_K` (`auto`,
`xla`, `passes`, `chunks`) picks the engine's form, for an A/B.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

FAST_K = 16  # the largest k XLA:GPU's own top-k kernel takes
FORMS = ("auto", "xla", "passes", "chunks")
CHUNK = 512  # `chunks`: elements per chunk (rows are padded to a whole number of them)
# `auto`: chunks for inputs of at most this many elements (the H100's crossover: chunks won at
# 32 x 128,256 and 64 x 49,152, passes at 64 x 128,256 and 128 x 49,152).
CHUNKS_MAX_ELEMENTS = 1 << 22


def default_form() -> str:
    form = os.environ.get("NORI_JAX_TOP_K", "auto")
    if form not in FORMS:
        raise ValueError(f"NORI_JAX_TOP_K={form!r} must be one of {FORMS}")
    return form


def top_k(x: jax.Array, k: int, form: str | None = None) -> tuple[jax.Array, jax.Array]:
    """(values, int32 indices) [..., k] of the k largest entries of each row of x (last axis),
    as `lax.top_k` returns them, for 1 <= k <= the row's length."""
    form = form or default_form()
    if form not in FORMS:
        raise ValueError(f"top-k form {form!r} must be one of {FORMS}")
    n = x.shape[-1]
    if not 1 <= k <= n:
        raise ValueError(f"k={k} must be from 1 to the row's length {n}")
    if k <= FAST_K or form == "xla":
        return jax.lax.top_k(x, k)
    if form == "auto":
        form = "chunks" if x.size <= CHUNKS_MAX_ELEMENTS else "passes"
    if form == "passes":
        return _passes(x, k)
    return _chunks(x, k)


def _passes(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    # Masking with -inf must not tie with a value of the row: -inf entries become the lowest
    # finite value for the passes and -inf again in the result.
    lowest = jnp.finfo(x.dtype).min
    work = jnp.maximum(x, lowest)
    values, ids = [], []
    while k > 0:
        take = min(k, FAST_K)
        v, i = jax.lax.top_k(work, take)
        values.append(v)
        ids.append(i)
        k -= take
        if k:
            work = jnp.put_along_axis(work, i, -jnp.inf, axis=-1, inplace=False)
    v = jnp.concatenate(values, axis=-1)
    return jnp.where(v == lowest, x.dtype.type(-jnp.inf), v), jnp.concatenate(ids, axis=-1)


def _chunks(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    n = x.shape[-1]
    pad = -n % CHUNK
    if pad:  # padding loses every comparison, and is never among k <= n
        x_pad = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)], constant_values=-jnp.inf)
    else:
        x_pad = x
    chunks = x_pad.reshape(*x.shape[:-1], -1, CHUNK)
    v, i = jax.lax.top_k(chunks, min(k, CHUNK))  # [..., C, k] per chunk
    base = (jnp.arange(chunks.shape[-2], dtype=jnp.int32) * CHUNK)[:, None]
    cand_v = v.reshape(*x.shape[:-1], -1)
    cand_i = (i + base).reshape(*x.shape[:-1], -1)
    # Candidates are in index order chunk by chunk, so ties keep the lower index first.
    best_v, at = jax.lax.top_k(cand_v, k)
    return best_v, jnp.take_along_axis(cand_i, at, axis=-1)
