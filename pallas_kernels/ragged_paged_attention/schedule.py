"""Work items of one ragged step, computed in jnp from the StepPlan metadata (static shapes only).

The kernel walks a flat list of items, decode items first:

    decode item  w in [0, num_decode * Hkv * splits):      (seq, kv head, split)
    prefill item w in [.., + num_parts * Hkv):              (part, kv head)

A prefill tile is `tokens_per_tile` consecutive query tokens of one prefill sequence (the last
tile of a sequence may be partial). Tiles never cross sequences, so a tile's rows share one page
table row. A part is a tile over a range of its KV blocks: every tile is one part unless the step
has too little prefill work to keep every SM busy to the end (`prefill_parts`), then long tiles
are cut into up to `max_splits` parts, whose partial outputs prefill_merge.py combines. Parts come
longest first, so the kernel's snake (mgpu_items.snake_item) pairs long with short.

Everything here is loop-free on purpose: `jnp.searchsorted`'s default method lowers to an XLA while
loop, and on a GPU each iteration of a while loop waits for the host to read its predicate. Once
per layer, that turned the engine's step from device-bound into host-bound (docs/benchmarks.md).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

META_NUM_DECODE = 0
META_NUM_SEQS = 1
META_NUM_PARTS = 2
META_SIZE = 4

# Columns of the parts table (int32[MP, PART_COLUMNS]), one row per part, longest first.
PART_SEQ, PART_TOK0, PART_B0, PART_B1, PART_INDEX, PART_COUNT, PART_TILE = range(7)
PART_COLUMNS = 8  # one spare column: rows of 32 bytes

# Cutting tiles: parts of about a quarter of an SM's share of the step's prefill blocks (a CTA then
# takes about four, and the longest-first snake evens them out), never below MIN_PART_BLOCKS.
PARTS_PER_CTA = 4
MIN_PART_BLOCKS = 2


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
    """(tile_seq int32[MT], tile_tok int32[MT], num_tiles int32[]): the step's prefill tiles in
    token order (entries past num_tiles repeat the last sequence's values; never used)."""
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
    return tile_seq, tile_tok.astype(jnp.int32), tile_end[-1]


class Parts(NamedTuple):
    meta: jax.Array  # int32[META_SIZE]
    parts: jax.Array  # int32[MT * max_splits, PART_COLUMNS], longest first
    tile_tok: jax.Array  # int32[MT]: first token of each tile, in token order (prefill_merge.py)
    tile_parts: jax.Array  # int32[MT]: parts of each tile (0 past the last tile)


def prefill_parts(
    cu_q_lens: jax.Array,  # int32[S + 1]
    kv_lens: jax.Array,  # int32[S]
    distribution: jax.Array,  # int32[2]
    *,
    num_tokens: int,
    tokens_per_tile: int,
    block_kv: int,
    num_kv_heads: int,
    num_ctas: int,
    max_splits: int = 1,
) -> Parts:
    """The step's prefill parts (module docstring), longest first.

    A tile of nb KV blocks (up to its last token's causal position) is cut into
    k = clip(round(nb / target), 1, max_splits) parts of nb // k or nb // k + 1 blocks, where
    target is the SM's share of all tiles' blocks times kv heads, over PARTS_PER_CTA, and at least
    MIN_PART_BLOCKS. With max_splits == 1 every tile is one part of blocks [0, nb).
    """
    num_decode, num_seqs = distribution[0], distribution[1]
    tile_seq, tile_tok, num_tiles = prefill_tiles(
        cu_q_lens, distribution, num_tokens=num_tokens, tokens_per_tile=tokens_per_tile
    )
    mt = tile_seq.shape[0]
    valid = jnp.arange(mt, dtype=jnp.int32) < num_tiles
    seq_start, seq_end = cu_q_lens[tile_seq], cu_q_lens[tile_seq + 1]
    last_tok = jnp.minimum(tile_tok + tokens_per_tile, seq_end) - 1
    # KV blocks up to the causal position of the tile's last token.
    visible = kv_lens[tile_seq] - (seq_end - seq_start) + (last_tok - seq_start) + 1
    nb = jnp.where(valid, (visible + block_kv - 1) // block_kv, 0).astype(jnp.int32)
    if max_splits == 1:
        k = valid.astype(jnp.int32)
    else:
        share = jnp.sum(nb) * num_kv_heads / (num_ctas * PARTS_PER_CTA)
        target = jnp.maximum(share, MIN_PART_BLOCKS)
        k = jnp.clip(jnp.round(nb / target), 1, max_splits).astype(jnp.int32)
        k = jnp.where(valid, jnp.minimum(k, jnp.maximum(nb, 1)), 0)
    # Part p belongs to the tile whose cumulative part count first exceeds p (loop-free).
    part_end = jnp.cumsum(k, dtype=jnp.int32)
    mp = mt * max_splits
    p = jnp.arange(mp, dtype=jnp.int32)
    tile = jnp.minimum(jnp.searchsorted(part_end, p, side="right", method="compare_all"), mt - 1)
    tile = tile.astype(jnp.int32)
    kt, nbt = k[tile], nb[tile]
    j = p - (part_end[tile] - kt)
    safe_k = jnp.maximum(kt, 1)
    b0 = j * nbt // safe_k
    b1 = (j + 1) * nbt // safe_k
    num_parts = part_end[-1]
    exists = p < num_parts
    cols = [tile_seq[tile], tile_tok[tile], b0, b1, j, kt, tile, jnp.zeros_like(p)]
    table = jnp.where(exists[:, None], jnp.stack(cols, axis=1), 0).astype(jnp.int32)
    # Longest first (stable: equal parts keep token order, a tile's parts stay together).
    order = jnp.argsort(jnp.where(exists, b1 - b0, -1), descending=True, stable=True)
    meta = jnp.stack([num_decode, num_seqs, num_parts, jnp.int32(0)]).astype(jnp.int32)
    return Parts(meta, table[order], tile_tok, k)
