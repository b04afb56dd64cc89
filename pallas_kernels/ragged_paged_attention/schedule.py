"""Work items of one ragged step, computed in jnp from the StepPlan metadata (static shapes only).

The kernel walks a flat list of items, decode items first:

    decode item  w in [0, num_decode * Hkv * splits):      (seq, kv head, split)
    prefill item w in [.., + num_tiles * Hkv):              (tile, kv head)

A prefill tile is `tokens_per_tile` consecutive query tokens of one prefill sequence (the last
tile of a sequence may be partial). Tiles never cross sequences, so a tile's rows share one page
table row.

Everything here is loop-free on purpose: `jnp.searchsorted`'s default method lowers to an XLA while
loop, and on a GPU each iteration of a while loop waits for the host to read its predicate. Once
per layer, that turned the engine's step from device-bound into host-bound (docs/benchmarks.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

META_NUM_DECODE = 0
META_NUM_SEQS = 1
META_NUM_TILES = 2
META_SIZE = 4


def max_prefill_tiles(num_tokens: int, num_seqs: int, tokens_per_tile: int) -> int:
    """Upper bound of sum_s cdiv(q_len_s, tokens_per_tile) over any valid step."""
    return -(-num_tokens // tokens_per_tile) + num_seqs


def prefill_tiles(
    cu_q_lens: jax.Array,  # int32[S + 1]
    distribution: jax.Array,  # int32[2]
    *,
    num_tokens: int,
    tokens_per_tile: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Returns (meta int32[META_SIZE], tile_seq int32[MT], tile_tok int32[MT])."""
    num_seqs_max = cu_q_lens.shape[0] - 1
    num_decode, num_seqs = distribution[0], distribution[1]
    s = jnp.arange(num_seqs_max, dtype=jnp.int32)
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    is_prefill = (s >= num_decode) & (s < num_seqs)
    tiles = jnp.where(is_prefill, (q_lens + tokens_per_tile - 1) // tokens_per_tile, 0)
    tile_end = jnp.cumsum(tiles, dtype=jnp.int32)  # [S]
    mt = max_prefill_tiles(num_tokens, num_seqs_max, tokens_per_tile)
    k = jnp.arange(mt, dtype=jnp.int32)
    # [MT, S] comparisons fused into one reduction: no while loop (see the module docstring).
    tile_seq = jnp.searchsorted(tile_end, k, side="right", method="compare_all")
    tile_seq = jnp.minimum(tile_seq, num_seqs_max - 1)
    tile_seq = tile_seq.astype(jnp.int32)
    first = tile_end[tile_seq] - tiles[tile_seq]
    tile_tok = cu_q_lens[tile_seq] + (k - first) * tokens_per_tile
    meta = jnp.stack([num_decode, num_seqs, tile_end[-1], jnp.int32(0)]).astype(jnp.int32)
    return meta, tile_seq, tile_tok.astype(jnp.int32)
