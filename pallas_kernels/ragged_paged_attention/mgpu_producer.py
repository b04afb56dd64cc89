"""Producer warpgroup: Q rows and K/V pages into SMEM with the bulk copy engine (TMA).

fp8 pages store V transposed (kv_layout.py): a page's V copy lands as one contiguous [D,
page_size] chunk of the block's V^T stage (Statics.v_chunk).

With 16-token pages a 128-token block takes 16 copies of 2 KiB (head_dim 64), and one thread
issuing them all, with their page-id loads and barrier arrivals, can fall behind the compute
warpgroups. With tuning.producer_warps == 4 the warpgroup's warps share the copies: warp w issues
the K (w even) or V (w odd) copies of the pages i with i % lanes == w // 2 (lanes: 2 where a
block has an even number of pages, else 1; idle warps return at once). Warp 0 issues Q: a decode
item's in one copy, a prefill tile's in one copy per token and warpgroup, after waiting for the
Q slot. The first two items of a CTA find their slots fresh, and there the 2 * lanes active warps
share a prefill tile's Q copies (token k by warp k % (2 * lanes)) before their first K/V block: a
CTA with one item (a short chunk) waits for its Q before its first block, and one thread issuing
every token's copy would stand on that path.

Every warp that issues copies into a stage also waits on that stage's release (kv_free): it can
never be more than one phase behind, because the next release needs its own copies first.
"""

from __future__ import annotations

import functools

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

PRODUCER_KEYS = ("seq", "head", "tok0", "b0", "b1")  # few: the producer has 32-40 registers


def producer(st: Statics, items: Items, cta, r: Refs) -> None:
    if st.tuning.producer_warps == 1:
        _produce(st, items, cta, r, warp=None)
        return

    lanes = 2 if st.pages_per_block % 2 == 0 else 1

    def per_warp(warp):
        pl.when(lax.div(warp, 2) < lanes)(lambda: _produce(st, items, cta, r, warp, lanes))

    plgpu.warp_map(per_warp)


def _when(cond, body) -> None:
    """body() under pl.when(cond); cond None: unconditionally (the single-thread producer)."""
    if cond is None:
        body()
    else:
        pl.when(cond)(body)


def _produce(st: Statics, items: Items, cta, r: Refs, warp, lanes: int = 1) -> None:
    """The producer's walk over the items. warp None: one thread issues every copy. Otherwise
    this warp's share (module docstring): K or V by warp parity, page lane warp // 2."""
    g, bk, stages, ps = st.group, st.tuning.block_kv, st.tuning.num_stages, st.page_size
    tpw, num_ctas = st.tokens_per_wg, st.tuning.num_ctas
    lane = 0 if warp is None else lax.div(warp, 2)
    issues_q = None if warp is None else warp == 0  # waits for Q slots and issues Q (below)
    q_warps = 2 * lanes  # the active warps, who share a CTA's first two prefill tiles' Q

    def issues(kind):  # does this thread issue the copies of `kind` (0: K, 1: V)?
        return None if warp is None else lax.rem(warp, 2) == kind

    def block_source(seq, b):
        """This thread's page ids of KV block b (pages j * lanes + lane), and the row offset
        where a page holds several blocks; loaded before waiting for the slot."""
        if ps <= bk:
            ppb = st.pages_per_block
            return [r.page_table[seq, b * ppb + j * lanes + lane] for j in range(ppb // lanes)], 0
        bpp = jnp.int32(st.blocks_per_page)
        return [r.page_table[seq, lax.div(b, bpp)]], lax.rem(b, bpp) * bk

    # fp8 pages store V^T (kv_layout.py): their V copies take tokens as columns, [D, tokens]
    v_transposed = r.kv_values is not None

    def source(kind, page, head, tokens=None):  # GMEM [tokens, D] (V^T: [D, tokens]); None: all
        if kind == 1 and v_transposed:
            values = r.kv_values.at[page, head, 1]
            return values if tokens is None else values.at[:, tokens]
        rows = r.kv_pages.at[page, head, kind]
        return rows if tokens is None else rows.at[tokens]

    def copy(kind, src, tokens, slot):
        stage = (r.k_smem, r.v_smem)[kind].at[slot]
        if kind == 1 and v_transposed:  # the chunk's [D, v_chunk] slab (Statics.v_chunk)
            dst = stage.at[pl.ds(tokens.start // st.v_chunk * st.head_dim, st.head_dim)]
        else:
            dst = stage.at[tokens]
        plgpu.copy_gmem_to_smem(src, dst, (r.k_full, r.v_full)[kind].at[slot])

    def issue_block(pages, row0, head, slot):
        for kind in (0, 1):

            def issue_kind(kind=kind):
                if ps > bk:  # the block is a slice of one page
                    src = source(kind, pages[0], head, pl.ds(row0, bk))
                    copy(kind, src, pl.ds(0, bk), slot)
                    return
                for j, page in enumerate(pages):  # one copy per page
                    for lane_v in range(lanes):  # static destination tokens per lane
                        tokens = pl.ds((j * lanes + lane_v) * ps, ps)
                        src = source(kind, page, head)
                        _when(
                            None if lanes == 1 else lane == lane_v,
                            lambda src=src, tokens=tokens: copy(kind, src, tokens, slot),
                        )

            _when(issues(kind), issue_kind)

    def item_body(i, w, it, kvc):
        qs = lax.rem(i, 2)

        def _q():
            @pl.when(i >= 2)  # the Q slot's previous item must have stored its output
            def _wait_q_slot():
                prev = w - 2 * num_ctas  # CTA's item i - 2 (Items.item_at)
                pl.when(items.is_decode(prev))(lambda: plgpu.barrier_wait(r.qd_free.at[qs]))
                pl.when(items.is_prefill(prev))(lambda: plgpu.barrier_wait(r.qp_free.at[qs]))

            @pl.when(items.is_decode(w))
            def _q_decode():
                src = r.q.at[it["tok0"], it["head"]]  # [G, D]
                dst = r.q_smem.at[qs, items.decode_owner(i), pl.ds(0, g)]
                plgpu.copy_gmem_to_smem(src, dst, r.qd_full.at[qs])

            # A prefill tile's Q copies: all of them where one thread issues every copy; with
            # several warps, those of the tiles after a CTA's first two (the first two's below)
            mine = items.is_prefill(w) if warp is None else items.is_prefill(w) & (i >= 2)
            pl.when(mine)(lambda: _q_prefill(jnp.int32(0), 1))

        def _q_prefill(first, every):
            """Tokens first, first + every, ... of each warpgroup's Q rows: one copy each."""
            for wg in range(st.tuning.prefill_boxes):
                # tokens_per_wg tokens from `start` (clamped into [0, T), tile_rows), one copy
                # of G heads each (a [G, D] slab of q) into rows token * G + g. Per-step
                # interleaving: a call of one-box tiles copies the box into each warpgroup's
                # (the same copies per tile either way: qp_full's arrival count is static).
                offset = wg * tpw
                if wg and items.step_mix is not None:
                    offset = jnp.where(items.step_mix, 0, offset)
                start = tile_rows(st, it["tok0"] + offset)

                def one(j, _, wg=wg, start=start):
                    k = first + j * every
                    src = r.q.at[start + k, it["head"]]  # [G, D]
                    dst = r.q_smem.at[qs, wg, pl.ds(k * g, g)]
                    plgpu.copy_gmem_to_smem(src, dst, r.qp_full.at[qs])
                    return ()

                lax.fori_loop(0, lax.div(tpw - first + (every - 1), jnp.int32(every)), one, ())

        _when(issues_q, _q)
        # A CTA's first two prefill tiles find their Q slots fresh: every active warp issues a
        # share of their Q copies, token k by warp k % q_warps (later tiles' Q, one item ahead
        # of the compute, is warp 0's after the slot's wait).
        if warp is not None:
            pl.when(items.is_prefill(w) & (i < 2))(lambda: _q_prefill(warp, q_warps))

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

    def _drain_q():
        for j in range(2):
            i = n - 2 + j
            w = items.item_at(cta, i, num_ctas)
            qs = lax.rem(jnp.maximum(i, 0), 2)
            for kind, free in ((items.is_decode, r.qd_free), (items.is_prefill, r.qp_free)):
                pl.when((i >= 0) & kind(w))(functools.partial(plgpu.barrier_wait, free.at[qs]))

    _when(issues_q, _drain_q)
