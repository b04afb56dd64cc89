"""Merges of partial attention outputs by their log-sum-exp (flash-decoding's merge).

Two kinds of partials, one merge (`merge_by_lse`): split decode (tuning.decode_splits: each split
of a decode sequence's KV blocks writes an f32 partial and its rows' log2-sum-exp) and cut
prefill tiles (tuning.prefill_kv_splits, schedule.prefill_parts: part j of a tile computes its
rows over its KV blocks only and writes its normalised output into the kernel's `out[j]` and its
rows' log2-sum-exp into `part_lse[j]`, mgpu_consumer.py). Each row's result is

    sum_j 2^(lse_j - top) * o_j / sum_j 2^(lse_j - top),   top = max_j lse_j.

Rows of prefill tiles that were not cut (and decode rows) are out[0] as is. The prefill merge
reads all K output buffers densely (static shapes): it costs K - 1 output-sized reads, which is
why default_tuning cuts only buckets with few tiles.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def merge_by_lse(parts: list[jax.Array], lses: list[jax.Array]) -> jax.Array:
    """f32 merge of partial outputs `parts` ([..., D] each) by their log2-sum-exp `lses` ([...]
    each; -inf where a part is absent or saw no key). Elementwise over the parts (Python loops,
    no reduction over an axis), so that XLA fuses the weights and the sum into one kernel. A part
    of weight 0 is never read: never-written memory may hold anything (NaN)."""
    top = functools.reduce(jnp.maximum, lses)
    top = jnp.where(jnp.isfinite(top), top, 0.0)  # rows with no part: weights 0, result 0
    wts = [jnp.exp2(x - top) for x in lses]
    total = sum(
        w[..., None] * jnp.where(w[..., None] > 0, o.astype(jnp.float32), 0.0)
        for o, w in zip(parts, wts, strict=True)
    )
    return total / jnp.maximum(sum(wts), 1e-30)[..., None]


def combine_splits(
    out: jax.Array,  # [T, Hq, D]
    opart: jax.Array,  # f32[S * Hkv * splits, G, D]
    lse: jax.Array,  # f32[S * Hkv * splits, 64]   log2-sum-exp per row
    cu_q_lens: jax.Array,  # int32[S + 1]
    num_decode: jax.Array,  # int32[]
    *,
    num_kv_heads: int,
    splits: int,
) -> jax.Array:
    """Merge the decode splits and write the decode rows into `out`."""
    num_tokens, hq, d = out.shape
    num_seqs = cu_q_lens.shape[0] - 1
    g = hq // num_kv_heads
    o = opart.reshape(num_seqs, num_kv_heads, splits, g, d)
    lse = lse[:, :g].reshape(num_seqs, num_kv_heads, splits, g)
    valid_seq = (jnp.arange(num_seqs) < num_decode)[:, None, None]  # others were never written
    lses = [jnp.where(valid_seq, lse[:, :, j], -jnp.inf) for j in range(splits)]
    merged = merge_by_lse([o[:, :, j] for j in range(splits)], lses)
    merged = merged.reshape(num_seqs, hq, d).astype(out.dtype)
    # Decode sequence s owns token cu_q_lens[s] == s; the first min(S, T) rows hold every decode
    # token.
    if num_seqs < num_tokens:
        merged = jnp.pad(merged, ((0, num_tokens - num_seqs), (0, 0), (0, 0)))
    is_dec = (jnp.arange(num_tokens) < num_decode)[:, None, None]
    # One select over the whole output, not out.at[:S].set(...): XLA's GPU dynamic-slice fusion
    # took that update of the kernel's output, fed by the kernel's other outputs, into one fusion
    # with the kernel and failed to compile it ("a cycle is detected", docs/benchmarks.md run 10).
    return jnp.where(is_dec, merged[:num_tokens], out)


def merge_prefill_parts(
    out: jax.Array,  # [K, T, Hkv, G, D]   per part index: rows of the parts with that index
    part_lse: jax.Array | None,  # f32[K, Hkv, MT * boxes, 64]  by tile and Q box row
    tile_tok: jax.Array,  # int32[MT]  first token of each tile, in token order
    tile_parts: jax.Array,  # int32[MT]  parts of each tile (0 past the last tile)
    cu_q_lens: jax.Array,  # int32[S + 1]
    distribution: jax.Array,  # int32[2]
    *,
    group: int,
    tokens_per_wg: int,
    boxes_per_tile: int,
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
    # Where the kernel held each token: Q box wg of its tile (tuning.prefill_boxes), which
    # starts at min(first token, T - tokens_per_wg) (mgpu_items.tile_rows), G rows per token.
    wg = (t - tile_tok[tile]) // tokens_per_wg
    box_start = jnp.minimum(tile_tok[tile] + wg * tokens_per_wg, num_tokens - tokens_per_wg)
    box = jnp.where(split, tile * boxes_per_tile + wg, 0)  # [T]
    row = jnp.where(split[:, None], (t - box_start)[:, None] * group + jnp.arange(group), 0)
    count = tile_parts[tile][:, None, None]  # [T, 1, 1]
    lses = [  # K x [T, Hkv, G]; -inf for parts the token's tile does not have
        jnp.where(j < count, jnp.moveaxis(part_lse[j][:, box[:, None], row], 0, 1), -jnp.inf)
        for j in range(k)
    ]
    merged = merge_by_lse([out[j] for j in range(k)], lses).astype(out.dtype)
    return jnp.where(split[:, None, None, None], merged, out[0])
