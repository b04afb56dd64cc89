"""Work items of one ragged step, computed in jnp from the StepPlan metadata (static shapes only).

The kernel walks a flat list of items, decode items first:

    decode item  w in [0, num_decode * Hkv * splits):      (seq, kv head, split)
    prefill item w in [.., + num_parts * Hkv):              (part, kv head)

A prefill tile is `tokens_per_tile` consecutive query tokens of one prefill sequence (the last
tile of a sequence may be partial). Tiles never cross sequences, so a tile's rows share one page
table row. A part is a tile over a range of its KV blocks: every tile is one part unless the step
has too little prefill work to keep every SM busy to the end (`prefill_parts`), then long tiles
are cut into up to `max_splits` parts, whose partial outputs partial_merge.py combines. Parts come
from the last tile to the first (longest first within a sequence), so the kernel's snake
(mgpu_items.snake_item) pairs long with short.

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
META_INTERLEAVE = 3  # tuning.prefill_interleave="per_step": 1 where this call's tiles interleave
META_SIZE = 4

# Columns of the parts table (int32[MP, PART_COLUMNS]), one row per part in the kernel's order.
PART_SEQ, PART_TOK0, PART_B0, PART_B1, PART_INDEX, PART_COUNT, PART_TILE = range(7)
PART_COLUMNS = 8  # one spare column: rows of 32 bytes

# Cutting tiles: parts of about a quarter of an SM's share of the step's prefill blocks (a CTA then
# takes about four, and the longest-first snake evens them out), never below MIN_PART_BLOCKS.
PARTS_PER_CTA = 4
MIN_PART_BLOCKS = 2

# The per-step choice's cost model (interleave_pays), in units of one 64-row Q box over one KV
# block of the paired form (with ping-pong). An interleaved box-block costs a fifth more: no
# ping-pong, and each warpgroup also waits for and releases the other's blocks. An item costs
# about one box-block of its own (its Q, epilogue and, interleaved, the hand-over). Fitted to
# the forty-first session's H100 A/B of the two forms (docs/benchmarks.md, "Prefill tiles on
# both compute warpgroups"): at 9q/3kv/64 and 32q/8kv/64, chunks of 512 and 1,024 tokens from
# position 0 and after 7,168-7,680 cached tokens, it picks the faster form of every pair that
# differed by more than the spread.
INTERLEAVED_BLOCK_COST = 1.2
ITEM_COST = 1.0


def with_padding_sequence(
    kv_lens: jax.Array,  # int32[S]
    cu_q_lens: jax.Array,  # int32[S + 1]
    distribution: jax.Array,  # int32[2]
    *,
    num_tokens: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The step with its padding tokens as one more prefill sequence, which has no KV: returns
    (kv_lens int32[S + 1], cu_q_lens int32[S + 2], distribution) for the kernel.

    Sequence S owns the tokens past cu_q_lens[num_seqs] with kv_len 0, and the padding sequences
    [num_seqs, S) become empty prefill sequences (no tokens, no KV). The kernel computes the
    padding tokens' rows over zero KV blocks and stores zeros there (mgpu_consumer.normalise), so
    no masking pass over the whole output runs after it: one XLA kernel less per call, and per
    engine layer. Their page-table row is never read (no blocks), so the table keeps S rows.
    """
    num_seqs_max = kv_lens.shape[0]
    num_seqs = distribution[1]
    s = jnp.arange(num_seqs_max + 1, dtype=jnp.int32)
    cu = jnp.where(s <= num_seqs, cu_q_lens, cu_q_lens[num_seqs])  # empty padding sequences
    cu = jnp.concatenate([cu, jnp.full((1,), num_tokens, jnp.int32)])
    lens = jnp.concatenate([jnp.where(s[:-1] < num_seqs, kv_lens, 0), jnp.zeros(1, jnp.int32)])
    dist = jnp.stack([distribution[0], jnp.int32(num_seqs_max + 1)])
    return lens, cu.astype(jnp.int32), dist.astype(jnp.int32)


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
    parts: jax.Array  # int32[MT * max_splits, PART_COLUMNS], in the kernel's order
    tile_tok: jax.Array  # int32[MT]: first token of each tile, in token order (partial_merge.py)
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
    """The step's prefill parts (module docstring): tiles from the last to the first, a tile's
    parts together. Within a sequence that is longest first (a later tile sees more KV), and the
    parts of a cut tile are of about equal size.

    A tile of nb KV blocks (up to its last token's causal position) is cut into
    k = clip(round(nb / target), 1, max_splits) parts of nb // k or nb // k + 1 blocks, where
    target is an SM's share of the step's KV blocks (prefill tiles' and decode rows', times kv
    heads) over PARTS_PER_CTA, and at least MIN_PART_BLOCKS. With max_splits == 1 every tile is
    one part of blocks [0, nb).
    """
    num_decode, num_seqs = distribution[0], distribution[1]
    tile_seq, tile_tok, num_tiles = prefill_tiles(
        cu_q_lens, distribution, num_tokens=num_tokens, tokens_per_tile=tokens_per_tile
    )
    mt = tile_seq.shape[0]
    i = jnp.arange(mt, dtype=jnp.int32)
    valid = i < num_tiles
    seq_start, seq_end = cu_q_lens[tile_seq], cu_q_lens[tile_seq + 1]
    last_tok = jnp.minimum(tile_tok + tokens_per_tile, seq_end) - 1
    # KV blocks up to the causal position of the tile's last token.
    visible = kv_lens[tile_seq] - (seq_end - seq_start) + (last_tok - seq_start) + 1
    # (A tile of the padding sequence, with_padding_sequence, sees nothing: visible <= 0.)
    nb = jnp.where(valid, jnp.maximum(visible + block_kv - 1, 0) // block_kv, 0).astype(jnp.int32)
    meta_of = lambda n: jnp.stack([num_decode, num_seqs, n, jnp.int32(0)]).astype(jnp.int32)  # noqa: E731
    zero = jnp.zeros_like(i)
    # Tiles from the last to the first: position i holds tile num_tiles - 1 - i.
    rev = jnp.clip(num_tiles - 1 - i, 0, mt - 1)
    if max_splits == 1:  # the tiles themselves: no part count to accumulate or search
        cols = [tile_seq[rev], tile_tok[rev], zero, nb[rev], zero, zero + 1, rev, zero]
        table = jnp.where(valid[:, None], jnp.stack(cols, axis=1), 0).astype(jnp.int32)
        return Parts(meta_of(num_tiles), table, tile_tok, valid.astype(jnp.int32))
    s = jnp.arange(kv_lens.shape[0], dtype=jnp.int32)
    decode_blocks = jnp.where(s < num_decode, (kv_lens + block_kv - 1) // block_kv, 0)
    share = (jnp.sum(nb) + jnp.sum(decode_blocks)) * num_kv_heads / (num_ctas * PARTS_PER_CTA)
    target = jnp.maximum(share, MIN_PART_BLOCKS)
    k = jnp.clip(jnp.round(nb / target), 1, max_splits).astype(jnp.int32)
    k = jnp.where(valid, jnp.minimum(k, jnp.maximum(nb, 1)), 0)
    k_rev = jnp.where(valid, k[rev], 0)
    # Part p belongs to the reversed position whose cumulative part count first exceeds p
    # ([MP, MT] comparisons: no while loop).
    part_end = jnp.cumsum(k_rev, dtype=jnp.int32)
    p = jnp.arange(mt * max_splits, dtype=jnp.int32)
    pos = jnp.searchsorted(part_end, p, side="right", method="compare_all")
    pos = jnp.minimum(pos, mt - 1).astype(jnp.int32)
    tile = rev[pos]
    kt, nbt = k[tile], nb[tile]
    j = p - (part_end[pos] - kt)
    safe_k = jnp.maximum(kt, 1)
    cols = [tile_seq[tile], tile_tok[tile], j * nbt // safe_k, (j + 1) * nbt // safe_k, j, kt, tile]
    cols.append(jnp.zeros_like(p))
    num_parts = part_end[-1]
    table = jnp.where((p < num_parts)[:, None], jnp.stack(cols, axis=1), 0).astype(jnp.int32)
    return Parts(meta_of(num_parts), table, tile_tok, k)


def longest_chain(costs: jax.Array, num_ctas: int) -> jax.Array:
    """The largest per-CTA sum of item costs (f32[N], in the kernel's order) under the kernel's
    snake (mgpu_items.snake_item): rounds of num_ctas items, every other round reversed."""
    n = costs.shape[0]
    rounds = -(-n // num_ctas)
    c = jnp.pad(costs, (0, rounds * num_ctas - n)).reshape(rounds, num_ctas)
    c = jnp.where((jnp.arange(rounds) % 2 == 1)[:, None], c[:, ::-1], c)
    return c.sum(axis=0).max()


def _item_costs(decode: jax.Array, num_decode_items, prefill: jax.Array, num_prefill_items):
    """Costs in the kernel's item order: decode items [0, num_decode_items), then the prefill
    items; zero past them. decode, prefill: f32 per item of their kind (static lengths)."""
    n = decode.shape[0] + prefill.shape[0]
    w = jnp.arange(n, dtype=jnp.int32)
    wp = w - num_decode_items
    dec = decode[jnp.minimum(w, decode.shape[0] - 1)]
    pre = prefill[jnp.clip(wp, 0, prefill.shape[0] - 1)]
    return jnp.where(w < num_decode_items, dec, jnp.where(wp < num_prefill_items, pre, 0.0))


def interleave_pays(
    paired: Parts,
    boxes: Parts,
    kv_lens: jax.Array,  # int32[S]
    distribution: jax.Array,  # int32[2]
    *,
    num_kv_heads: int,
    decode_splits: int,
    block_kv: int,
    num_ctas: int,
) -> jax.Array:
    """Whether this step's longest CTA chain (longest_chain, the cost model above) is shorter
    with interleaved one-box tiles (`boxes`, tuning.prefill_interleave) than with paired tiles of
    one box per compute warpgroup (`paired`): a bool scalar. Interleaving halves each tile's
    chain of blocks and doubles the items, so it pays where the longest tile bounds the call
    (few tiles, or a chunk from position 0) and costs where the doubled items need another
    round of the SMs."""
    hkv = num_kv_heads
    s = jnp.arange(kv_lens.shape[0], dtype=jnp.int32)
    nb = (kv_lens + block_kv - 1) // block_kv
    dec_blocks = jnp.where(s < distribution[0], nb, 0) / decode_splits
    dec = jnp.repeat(ITEM_COST + dec_blocks, hkv * decode_splits)  # item = (seq, head, split)
    num_dec = distribution[0] * (hkv * decode_splits)

    def chain(plan: Parts, box_block_cost):
        blocks = (plan.parts[:, PART_B1] - plan.parts[:, PART_B0]).astype(jnp.float32)
        pre = jnp.repeat(ITEM_COST + box_block_cost(blocks), hkv)  # item = (part, head)
        return longest_chain(
            _item_costs(dec, num_dec, pre, plan.meta[META_NUM_PARTS] * hkv), num_ctas
        )

    # Interleaved: a tile of one block is warpgroup 0's alone (mgpu_consumer.py).
    mixed = chain(boxes, lambda b: jnp.where(b >= 2, INTERLEAVED_BLOCK_COST * b, b))
    return mixed < chain(paired, lambda b: 2.0 * b)  # two boxes over the tile's blocks


def per_step_parts(
    cu_q_lens: jax.Array,  # int32[S + 1]
    kv_lens: jax.Array,  # int32[S]
    distribution: jax.Array,  # int32[2]
    *,
    num_tokens: int,
    tokens_per_wg: int,
    block_kv: int,
    num_kv_heads: int,
    num_ctas: int,
    decode_splits: int,
) -> Parts:
    """The plan of tuning.prefill_interleave="per_step": the parts of one-box tiles where
    interleave_pays, else of two-box tiles, with meta[META_INTERLEAVE] saying which. Both
    tables are computed (static shapes; the two-box one padded to the other's rows) and one is
    selected: no branch, so no host round trip."""
    kw = dict(num_tokens=num_tokens, block_kv=block_kv, num_kv_heads=num_kv_heads,
              num_ctas=num_ctas)  # fmt: skip
    boxes = prefill_parts(cu_q_lens, kv_lens, distribution, tokens_per_tile=tokens_per_wg, **kw)
    paired = prefill_parts(
        cu_q_lens, kv_lens, distribution, tokens_per_tile=2 * tokens_per_wg, **kw
    )
    mix = interleave_pays(
        paired, boxes, kv_lens, distribution, num_kv_heads=num_kv_heads,
        decode_splits=decode_splits, block_kv=block_kv, num_ctas=num_ctas,
    )  # fmt: skip

    def pick(a, b):  # a where mix, else b padded to a's rows
        b = jnp.pad(b, [(0, a.shape[0] - b.shape[0])] + [(0, 0)] * (b.ndim - 1))
        return jnp.where(mix, a, b)

    meta = jnp.where(mix, boxes.meta, paired.meta).at[META_INTERLEAVE].set(mix.astype(jnp.int32))
    return Parts(meta, pick(boxes.parts, paired.parts), pick(boxes.tile_tok, paired.tile_tok),
                 pick(boxes.tile_parts, paired.tile_parts))  # fmt: skip
