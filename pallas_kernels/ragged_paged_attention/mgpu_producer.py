"""Producer warpgroup: Q rows and K/V pages into SMEM with the bulk copy engine (TMA)."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.ragged_paged_attention.mgpu_items import (
    Items,
    Refs,
    Statics,
    for_each_item,
    tile_rows,
)
from pallas_kernels.ragged_paged_attention.tuning import NUM_COMPUTE_WGS

PRODUCER_KEYS = ("seq", "head", "tok0", "b0", "b1")  # few: the producer has 40 registers


def producer(st: Statics, items: Items, cta, r: Refs) -> None:
    g, bk, stages = st.group, st.tuning.block_kv, st.tuning.num_stages
    tpw, num_ctas = st.tokens_per_wg, st.tuning.num_ctas

    def block_source(seq, b):
        """Page ids (and row offset) of KV block b; loaded before waiting for the slot."""
        if st.page_size <= bk:
            ppb = st.pages_per_block
            return [r.page_table[seq, b * ppb + i] for i in range(ppb)], 0
        bpp = jnp.int32(st.blocks_per_page)
        return [r.page_table[seq, lax.div(b, bpp)]], lax.rem(b, bpp) * bk

    def issue_block(pages, row0, head, slot):
        k_dst, v_dst = r.k_smem.at[slot], r.v_smem.at[slot]  # [bk, D] each
        k_bar, v_bar = r.k_full.at[slot], r.v_full.at[slot]
        if st.page_size <= bk:  # one K and one V copy per page
            for i, page in enumerate(pages):
                rows = pl.ds(i * st.page_size, st.page_size)
                plgpu.copy_gmem_to_smem(r.kv_pages.at[page, head, 0], k_dst.at[rows], k_bar)
                plgpu.copy_gmem_to_smem(r.kv_pages.at[page, head, 1], v_dst.at[rows], v_bar)
        else:  # the block is a slice of one page
            rows = pl.ds(row0, bk)
            plgpu.copy_gmem_to_smem(r.kv_pages.at[pages[0], head, 0, rows], k_dst, k_bar)
            plgpu.copy_gmem_to_smem(r.kv_pages.at[pages[0], head, 1, rows], v_dst, v_bar)

    def item_body(i, it, kvc):
        w = cta + i * num_ctas
        is_dec = items.is_decode(w)
        qs = lax.rem(i, 2)

        @pl.when(i >= 2)  # the Q slot's previous item must have stored its output
        def _wait_q_slot():
            prev_dec = items.is_decode(w - 2 * num_ctas)
            pl.when(prev_dec)(lambda: plgpu.barrier_wait(r.qd_free.at[qs]))
            pl.when(~prev_dec)(lambda: plgpu.barrier_wait(r.qp_free.at[qs]))

        @pl.when(is_dec)
        def _q_decode():
            src = r.q.at[it["head"], pl.ds(it["tok0"] * g, g)]  # [G, D]
            dst = r.q_smem.at[qs, items.decode_owner(i), pl.ds(0, g)]
            plgpu.copy_gmem_to_smem(src, dst, r.qd_full.at[qs])

        @pl.when(~is_dec)
        def _q_prefill():
            for wg in range(NUM_COMPUTE_WGS):
                # One box of tokens_per_wg tokens x G heads, clamped into [0, T) (see tile_rows).
                start = tile_rows(st, it["tok0"] + wg * tpw)
                src = r.q.at[it["head"], pl.ds(start * g, tpw * g)]  # [tpw * G, D]
                dst = r.q_smem.at[qs, wg, pl.ds(0, tpw * g)]
                plgpu.copy_gmem_to_smem(src, dst, r.qp_full.at[qs])

        def block_body(b, kvc):
            slot = lax.rem(kvc, stages)
            pages, row0 = block_source(it["seq"], b)
            pl.when(kvc >= stages)(lambda: plgpu.barrier_wait(r.kv_free.at[slot]))
            issue_block(pages, row0, it["head"], slot)
            return kvc + 1

        return lax.fori_loop(it["b0"], it["b1"], block_body, kvc)

    kvc, n = for_each_item(items, cta, num_ctas, PRODUCER_KEYS, item_body, jnp.int32(0))
    # Drain: observe the releases of the last stages and Q slots (a barrier must not end its life
    # with completions that one of its waiters has not seen).
    for j in range(stages):
        kb = kvc - stages + j
        pl.when(kb >= 0)(lambda kb=kb: plgpu.barrier_wait(r.kv_free.at[lax.rem(kb, stages)]))
    for j in range(2):
        i = n - 2 + j
        dec = items.is_decode(cta + i * num_ctas)
        qs = lax.rem(jnp.maximum(i, 0), 2)
        pl.when((i >= 0) & dec)(lambda qs=qs: plgpu.barrier_wait(r.qd_free.at[qs]))
        pl.when((i >= 0) & ~dec)(lambda qs=qs: plgpu.barrier_wait(r.qp_free.at[qs]))
