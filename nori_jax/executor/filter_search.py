"""Each filtering row's min-p / top-k / top-p threshold by a fixed number of counting passes,
without sorting the row.

The sampler keeps a row's tokens at or above one threshold (sampler.py). The sort form finds it
by sorting the row whole: its sampler program took 4.7 ms at 1,024 rows x 49,152 on the H200,
against 0.59 ms sampling the same rows unfiltered (docs/benchmarks.md, the sampler's
primitives). Both thresholds are
values of the row, and each is the smallest value at which a monotone test turns true:

- top-k: T_k, the k-th largest value, is the smallest value u with count(x > u) < k;
- top-p: the smallest value u >= T_k with mass(x > u) < top_p * Z, where mass sums
  exp(x - max) and Z is that sum over the top-k set (exactly k tokens by rank: those above T_k
  plus k - count(x > T_k) copies of exp(T_k - max), the ties at T_k the sort would keep).

(Between two values of the row the test does not change, so the smallest value where it holds is
one of the row's.) Floats map to 32-bit keys in the same order, and a search over keys finds the
smallest with a true test exactly: `BITS` bits of the key per pass, each pass testing
2**BITS - 1 pivots of every row in one read of the row, 32 / BITS passes per threshold. No data
decides how many passes run, so the program has no loop and no host synchronization; the result
equals the sort form's except where float rounding differs between a cumulative sum and a masked
sum at the top-p boundary itself.

Three forms: `sort`, `search` (a pass's pivots tested in one reduction over a broadcast row) and
`search_siblings` (one reduction a pivot over the same row, which XLA:GPU fuses into one read).
On an H100 (`benchmarks/engine/sampler_bench.py --forms`, docs/benchmarks.md), top_p 0.95 on R
filtering rows (16 to 256 of a batch of 256; 1,024 of 1,024):

| R | 49,152 tokens: sort / search / siblings (ms) | 128,256 tokens |
|---|---|---|
| 16 | **0.34** / 0.35 / 0.53 | 0.81 / **0.51** / 0.77 |
| 64 | **0.58** / 0.78 / 0.65 | 1.43 / **0.98** / 1.12 |
| 256 | 1.31 / 2.44 / **1.30** | 3.09 / 2.78 / **2.68** |
| 1,024 | 4.76 / 9.55 / **3.61** | 11.89 / 10.64 / **9.17** |

so `auto`, the default, takes for a bucket of R rows of V tokens on a GPU the form fastest there:
the siblings from SIBLINGS_MIN_ROWS rows, the broadcast search below that for vocabularies past
SORT_MAX_VOCAB, the sort otherwise. On other backends it takes the sort: the table is the GPU's,
and on the development machine's CPU the siblings' program compiles in 2.3 s against the sort's
0.17 s (16 or 256 rows x 49,152), which every start-up and test pays. `NORI_JAX_FILTER`
(`auto`, `sort`, `search`, `search_siblings`) picks the engine's form, for an A/B.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

FORMS = ("auto", "sort", "search", "search_siblings")
BITS = 4  # bits of the key settled per pass: 15 pivots a pass, 8 passes a threshold
_SIGN = np.uint32(0x80000000)  # numpy: a jnp constant would start JAX's backend at import
# `auto` on a GPU (the H100's table above): the siblings from this many filtering rows (even with
# the sort at 256 x 49,152, ahead beyond), the broadcast search below it past this vocabulary.
SIBLINGS_MIN_ROWS = 256
SORT_MAX_VOCAB = 65_536


def default_form() -> str:
    form = os.environ.get("NORI_JAX_FILTER", "auto")
    if form not in FORMS:
        raise ValueError(f"NORI_JAX_FILTER={form!r} must be one of {FORMS}")
    return form


def auto_form(rows: int, vocab: int, platform: str) -> str:
    """The form `auto` runs for a bucket of `rows` filtering rows of `vocab` tokens."""
    if platform != "gpu":
        return "sort"
    if rows >= SIBLINGS_MIN_ROWS:
        return "search_siblings"
    return "search" if vocab > SORT_MAX_VOCAB else "sort"


def float_to_key(x: jax.Array) -> jax.Array:
    """uint32 keys in the order of the float32 values (-0.0 just below +0.0; NaN never asked)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return jnp.where(bits & _SIGN, ~bits, bits | _SIGN)


def key_to_float(key: jax.Array) -> jax.Array:
    bits = jnp.where(key & _SIGN, key & ~_SIGN, ~key)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def smallest_true(
    test: Callable[[jax.Array], jax.Array], lo: jax.Array, hi: jax.Array, bits: int = BITS
) -> jax.Array:
    """float32[R]: the value of the smallest key in [lo, hi] (uint32[R]) at which `test` holds.

    `test(values float32[R, P]) -> bool[R, P]` must be monotone in the value (false below the
    answer, true from it on); where it is false even at `hi`, the answer is `hi`. The search
    counts the keys where the test fails: each pass adds the next `bits` bits of that count,
    testing its 2**bits - 1 candidates at once (those past `hi` count as true untested)."""
    if 32 % bits:
        raise ValueError(f"bits={bits} must divide 32")
    width = hi - lo
    failing = jnp.zeros_like(lo)  # keys lo .. lo + failing - 1 fail the test
    digits = jnp.arange(1, 1 << bits, dtype=jnp.uint32)
    for shift in range(32 - bits, -1, -bits):
        # Each candidate's count stays below 2**32: `failing` is a multiple of 2**(shift+bits).
        last = failing[:, None] + (digits << shift)[None, :] - 1  # [R, P] offsets
        inside = last <= width[:, None]
        fails = inside & ~test(key_to_float(lo[:, None] + jnp.where(inside, last, 0)))
        failing = failing + (jnp.sum(fails, axis=-1, dtype=jnp.uint32) << shift)
    # A test false even at `hi` (a top_p that rounded to 0.0 in float32) stops at `hi`. (As a
    # `where`: `jnp.minimum(failing, width)` made XLA's CPU compiler hang at bits=1.)
    found = key_to_float(jnp.where(failing > width, hi, lo + failing))
    # Where comparisons flush denormals to zero (XLA's float32 on CPU), every denormal tests as
    # zero does and the search stops at the most negative one: 0.0 compares alike, and reads so.
    return jnp.where(found == 0.0, jnp.float32(0.0), found)


def _sum_above(
    x: jax.Array, pivots: jax.Array, weight: jax.Array | None, siblings: bool
) -> jax.Array:
    """[R, P]: for each row of x and each of its pivots, the entries above the pivot counted
    (int32, weight None) or their weights summed. One reduction over the broadcast [R, V, P],
    or P row reductions over the same x (`siblings`, which XLA may fuse into one read; 5x the
    CPU compile time)."""
    if not siblings:
        above = x[:, :, None] > pivots[:, None, :]
        if weight is None:
            return jnp.sum(above, axis=1, dtype=jnp.int32)
        return jnp.sum(jnp.where(above, weight[:, :, None], 0.0), axis=1)
    cols = []
    for j in range(pivots.shape[1]):
        above = x > pivots[:, j : j + 1]
        if weight is None:
            cols.append(jnp.sum(above, axis=-1, dtype=jnp.int32))
        else:
            cols.append(jnp.sum(jnp.where(above, weight, 0.0), axis=-1))
    return jnp.stack(cols, axis=-1)


def search_thresholds(
    x: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    row_max: jax.Array,
    *,
    siblings: bool = False,
    bits: int = BITS,
) -> jax.Array:
    """float32[R]: each row's top-k-then-top-p threshold over x [R, V] (min-p already applied as
    -inf entries; `row_max` its finite maximum). top_k: int32[R], 0 = off; top_p in (0, 1]."""
    vocab = x.shape[-1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    lo = jnp.full_like(k, float_to_key(jnp.float32(-jnp.inf)), dtype=jnp.uint32)
    hi = float_to_key(row_max)
    t_k = smallest_true(lambda v: _sum_above(x, v, None, siblings) < k[:, None], lo, hi, bits)
    weight = jnp.exp(x - row_max[:, None])  # 0 at -inf
    above_k = x > t_k[:, None]
    ties = (k - jnp.sum(above_k, axis=-1, dtype=jnp.int32)).astype(jnp.float32)
    total = jnp.sum(jnp.where(above_k, weight, 0.0), axis=-1)
    total = total + jnp.where(ties > 0, ties * jnp.exp(t_k - row_max), 0.0)
    target = top_p * total
    t_p = smallest_true(
        lambda v: _sum_above(x, v, weight, siblings) < target[:, None], float_to_key(t_k), hi, bits
    )
    return jnp.where(top_p >= 1.0, t_k, t_p)
