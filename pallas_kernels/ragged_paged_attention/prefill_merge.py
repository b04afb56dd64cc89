"""Merge of split prefill tiles: the parts' partial outputs, weighted by their log-sum-exp.

schedule.prefill_parts may cut a prefill tile's KV blocks into k parts; part j computes the
tile's rows over its blocks only and writes its normalised output into the kernel's output
`out[j]` and its rows' log2-sum-exp into `part_lse[j]` (mgpu_consumer.py). Each row's result is

    sum_j 2^(lse_j - top) * o_j / sum_j 2^(lse_j - top),   top = max_j lse_j,

the same merge as split decode (flash-decoding). Rows of tiles that were not split (and decode
rows) are out[0] as is. The merge reads all K output buffers densely (static shapes): it costs
K - 1 output-sized reads, which is why default_tuning splits only buckets with few tiles.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def merge_prefill_parts(
    out: jax.Array,  # [K, T, Hkv, G, D]   per part index: rows of the parts with that index
    part_lse: jax.Array | None,  # f32[K, Hkv, MT * WGS, 64]  by tile and warpgroup Q box row
    tile_tok: jax.Array,  # int32[MT]  first token of each tile, in token order
    tile_parts: jax.Array,  # int32[MT]  parts of each tile (0 past the last tile)
    cu_q_lens: jax.Array,  # int32[S + 1]
    distribution: jax.Array,  # int32[2]
    *,
    group: int,
    tokens_per_wg: int,
    compute_wgs: int,
) -> jax.Array:
    """Returns [T, Hkv, G, D]: out[0] with the rows of split tiles merged over their parts."""
    k, num_tokens = out.shape[:2]
    if k == 1:
        return out[0]
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    prefill = (t >= cu_q_lens[distribution[0]]) & (t < cu_q_lens[distribution[1]])
    # The tile of each prefill token ([T, MT] comparisons, no while loop: schedule.py).
    tile = jnp.searchsorted(tile_tok, t, side="right", method="compare_all") - 1
    tile = jnp.clip(tile, 0, tile_tok.shape[0] - 1).astype(jnp.int32)
    split = prefill & (tile_parts[tile] > 1)  # [T]
    # Where the kernel held each token: warpgroup wg of its tile, in a Q box that starts at
    # min(first token, T - tokens_per_wg) (mgpu_items.tile_rows), G rows per token.
    wg = (t - tile_tok[tile]) // tokens_per_wg
    box_start = jnp.minimum(tile_tok[tile] + wg * tokens_per_wg, num_tokens - tokens_per_wg)
    box = jnp.where(split, tile * compute_wgs + wg, 0)  # [T]
    row = jnp.where(split[:, None], (t - box_start)[:, None] * group + jnp.arange(group), 0)
    # Elementwise over the K parts (Python loops, no reductions over an axis), so that XLA can
    # fuse the weights and the sum into one kernel.
    count = tile_parts[tile][:, None, None]  # [T, 1, 1]
    lse = [  # K x [T, Hkv, G]; -inf for parts that do not exist
        jnp.where(j < count, jnp.moveaxis(part_lse[j][:, box[:, None], row], 0, 1), -jnp.inf)
        for j in range(k)
    ]
    top = functools.reduce(jnp.maximum, lse)
    top = jnp.where(jnp.isfinite(top), top, 0.0)  # rows not merged
    wts = [jnp.exp2(x - top) for x in lse]  # 0 for parts that do not exist
    # Never-written rows may hold anything (NaN): only rows of positive weight are read.
    merged = sum(
        w[..., None] * jnp.where(w[..., None] > 0, out[j].astype(jnp.float32), 0.0)
        for j, w in enumerate(wts)
    )
    merged = (merged / jnp.maximum(sum(wts), 1e-30)[..., None]).astype(out.dtype)
    return jnp.where(split[:, None, None, None], merged, out[0])
