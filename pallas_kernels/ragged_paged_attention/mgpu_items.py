"""Static config and the scalar bookkeeping of the kernel's flat work list (mgpu_kernel.py)."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax.numpy as jnp
from jax import lax

from pallas_kernels.ragged_paged_attention import schedule
from pallas_kernels.ragged_paged_attention.schedule import (
    META_INTERLEAVE,
    META_NUM_DECODE,
    META_NUM_PARTS,
)
from pallas_kernels.ragged_paged_attention.tuning import ROWS, TuningConfig


@dataclasses.dataclass(frozen=True)
class Statics:
    """Everything static the kernel body needs (hashable: it keys the compile cache)."""

    num_tokens: int
    num_kv_heads: int
    group: int
    head_dim: int
    page_size: int
    pages_per_seq: int
    sm_scale: float
    soft_cap: float | None
    tuning: TuningConfig
    # Where wgmma's A operands (Q, then P) come from. "regs": registers, O accumulated in place
    # (fewest SMEM round trips). "smem": staged through swizzled SMEM tiles, O += a fresh product:
    # the form GPU interpret mode can run (its wgmma reads A from SMEM only). Same arithmetic.
    a_operands: str = "regs"
    # The dtype of wgmma's operands: the pages' dtype, or for fp8 pages (kv_fp8) float16 (Q and P
    # converted, K and V dequantized from their 8-bit stages, mgpu_consumer.py; float32 in
    # interpret mode when q is float32).
    mma_dtype: Any = None
    kv_fp8: bool = False

    @property
    def p_dtype(self):
        """P's dtype in P V: fp8 pages multiply an e4m3 P with the 8-bit V stage
        (reference.PROBS_DTYPE), other pages P in the operands' dtype."""
        return jnp.dtype(jnp.float8_e4m3fn) if self.kv_fp8 else self.mma_dtype

    @property
    def v_chunk(self) -> int:
        """fp8 pages: tokens per chunk of a V^T stage, min(page_size, block_kv). The stage is
        [block_kv / v_chunk * D, v_chunk]: chunk c (tokens [c * v_chunk, (c + 1) * v_chunk) of
        the block) is rows [c * D, (c + 1) * D), so each page's bulk copy fills a contiguous
        [D, page_size] slab, and P V is one wgmma per chunk."""
        return min(self.page_size, self.tuning.block_kv)

    @property
    def p_in_regs(self) -> bool:
        """P V takes P from registers (a_operands "regs", 16-bit P); an fp8 P is staged in SMEM."""
        return self.a_operands == "regs" and not self.kv_fp8

    @property
    def tokens_per_wg(self) -> int:
        return ROWS // self.group

    @property
    def tokens_per_tile(self) -> int:  # a prefill tile: tokens_per_wg per Q box
        return self.tuning.prefill_boxes * self.tokens_per_wg

    @property
    def pages_per_block(self) -> int:  # >= 1 when page_size <= block_kv
        return max(1, self.tuning.block_kv // self.page_size)

    @property
    def blocks_per_page(self) -> int:  # >= 1 when page_size >= block_kv
        return max(1, self.page_size // self.tuning.block_kv)


class Refs(NamedTuple):
    """The kernel's refs (shapes in mgpu_kernel.attention_kernel); None where a launch has none."""

    meta: Any
    kv_lens: Any
    cu_q_lens: Any
    page_table: Any
    parts: Any
    q: Any
    kv_pages: Any
    kv_values: Any
    kv_scales: Any
    out: Any
    opart: Any
    lse: Any
    part_lse: Any
    k_smem: Any
    v_smem: Any
    q_smem: Any
    qa_smem: Any
    pa_smem: Any
    o32_smem: Any
    lse_smem: Any
    ones_smem: Any
    part_lse_smem: Any
    dq_smem: Any
    q8_smem: Any
    mix_smem: Any
    mix_stats: Any
    k_full: Any
    v_full: Any
    kv_free: Any
    qd_full: Any
    qp_full: Any
    qd_free: Any
    qp_free: Any
    turn: Any
    mix_full: Any
    mix_free: Any


def cdiv(a, b):
    return lax.div(a + (b - 1), jnp.int32(b))


class Items:
    """Scalar bookkeeping of the flat item list (both roles compute exactly the same values)."""

    def __init__(self, st: Statics, r: Refs):
        self.st = st
        hkv, splits = st.num_kv_heads, st.tuning.decode_splits
        self.num_parts = r.meta[META_NUM_PARTS]
        self.num_decode_items = r.meta[META_NUM_DECODE] * (hkv * splits)
        self.num_items = self.num_decode_items + self.num_parts * hkv
        self.kv_lens_ref, self.cu_ref, self.parts_ref = r.kv_lens, r.cu_q_lens, r.parts
        # tuning.prefill_interleave="per_step": whether this call's prefill tiles are one box
        # on both compute warpgroups (schedule.per_step_parts), and its negation (a boolean
        # not has no warp-level lowering); None in the static forms
        self.step_mix = self.step_paired = None
        if st.tuning.prefill_per_step:
            self.step_mix = r.meta[META_INTERLEAVE] != 0
            self.step_paired = r.meta[META_INTERLEAVE] == 0

    def item_at(self, cta, i, num_ctas: int):
        return snake_item(cta, i, num_ctas)

    def count_for(self, cta, num_ctas: int):
        return snake_count(self.num_items, cta, num_ctas)

    def is_decode(self, w):
        return w < self.num_decode_items

    def is_prefill(self, w):  # not ~is_decode(w): boolean not has no warp-level lowering
        return w >= self.num_decode_items

    def decode_owner(self, i):
        """The compute warpgroup that computes this CTA's i-th item if it is a decode item. With
        decode_wgs == 2 it is i % 2, which is also the item's Q slot: each warpgroup keeps to one
        slot."""
        if self.st.tuning.decode_wgs == 1:
            return jnp.int32(0)
        return lax.rem(i, jnp.int32(self.st.tuning.decode_wgs))

    def describe(self, w):
        """Per item (int32 scalars): seq, kv head, decode token or tile's first token, kv_len,
        q_len, the sequence's token range, the KV block range; for prefill items also the part's
        index in its tile, the tile's part count and the tile (schedule.prefill_parts).
        is_decode(w) says which kind."""
        st = self.st
        hkv, splits, bk = st.num_kv_heads, st.tuning.decode_splits, st.tuning.block_kv
        is_dec = w < self.num_decode_items
        # Decode view (clamped so that its loads stay in bounds for prefill items too).
        wd = jnp.minimum(w, jnp.maximum(self.num_decode_items - 1, 0))
        sh, split = lax.div(wd, jnp.int32(splits)), lax.rem(wd, jnp.int32(splits))
        d_seq, d_head = lax.div(sh, jnp.int32(hkv)), lax.rem(sh, jnp.int32(hkv))
        # Prefill view: row `part` of the parts table (schedule.prefill_parts).
        wp = jnp.maximum(w - self.num_decode_items, 0)
        part = lax.div(wp, jnp.int32(hkv))
        p_head = lax.rem(wp, jnp.int32(hkv))

        def col(c):
            return self.parts_ref[part, c]

        p_seq = col(schedule.PART_SEQ)
        seq = jnp.where(is_dec, d_seq, p_seq)
        head = jnp.where(is_dec, d_head, p_head)
        kv_len = self.kv_lens_ref[seq]
        seq_start = self.cu_ref[seq]
        seq_end = self.cu_ref[seq + 1]
        tok0 = jnp.where(is_dec, seq_start, col(schedule.PART_TOK0))
        q_len = seq_end - seq_start
        # Block range. Decode: split `split` of the cdiv(kv_len, bk) blocks. Prefill: the part's
        # (within the blocks up to the position of the tile's last valid token).
        nb_dec = cdiv(kv_len, bk)
        b0_dec = lax.div(split * nb_dec, jnp.int32(splits))
        b1_dec = lax.div((split + 1) * nb_dec, jnp.int32(splits))
        b0 = jnp.where(is_dec, b0_dec, col(schedule.PART_B0))
        b1 = jnp.where(is_dec, b1_dec, col(schedule.PART_B1))
        return dict(
            seq=seq,
            head=head,
            tok0=tok0,
            kv_len=kv_len,
            q_len=q_len,
            seq_start=seq_start,
            seq_end=seq_end,
            b0=b0,
            b1=jnp.maximum(b1, b0),
            part_index=col(schedule.PART_INDEX),
            part_count=col(schedule.PART_COUNT),
            tile=col(schedule.PART_TILE),
        )


# CTA `cta` takes one item of every round of num_ctas items: round k's items go to the CTAs in
# order when k is even and in reverse when k is odd (a snake). Items come longest first (prefill
# tiles run from the most KV to the least), so plain round-robin would give CTA 0 the longest item
# of every round; the snake pairs long with short. With a few rounds per CTA that is most of the
# balance (docs/kernels.md).
def _snake_offset(cta, k, num_ctas: int):
    return jnp.where(lax.rem(k, 2) == 0, cta, num_ctas - 1 - cta)


def snake_item(cta, i, num_ctas: int):
    """Flat index of CTA cta's i-th item. Two items apart is two rounds apart:
    snake_item(cta, i - 2) == snake_item(cta, i) - 2 * num_ctas."""
    return i * num_ctas + _snake_offset(cta, i, num_ctas)


def snake_count(num_items, cta, num_ctas: int):
    """How many of num_items CTA cta takes."""
    rounds = lax.div(num_items, jnp.int32(num_ctas))
    rest = lax.rem(num_items, jnp.int32(num_ctas))  # items of the last, partial round
    return rounds + (_snake_offset(cta, rounds, num_ctas) < rest).astype(jnp.int32)


def for_each_item(items: Items, cta, num_ctas: int, keys: tuple[str, ...], body, init):
    """Run body(i, w, it, carry) -> carry over this CTA's items (i-th item, flat index w);
    returns (carry, item count).

    `it` holds the `keys` of items.describe for the i-th item; the scalars a role does not ask for
    are dead code, which matters to the producer's 32-40 registers.
    """

    def step(i, carry):
        w = items.item_at(cta, i, num_ctas)
        d = items.describe(w)
        return body(i, w, {k: d[k] for k in keys}, carry)

    n = items.count_for(cta, num_ctas)
    return lax.fori_loop(0, n, step, init), n


def tile_rows(st: Statics, first_tok):
    """First token of a warpgroup's Q box: first_tok, moved back so the box ends inside [0, T).

    Rows of tokens before first_tok then belong to other tiles: computed, never stored.
    """
    return jnp.minimum(first_tok, st.num_tokens - st.tokens_per_wg)
