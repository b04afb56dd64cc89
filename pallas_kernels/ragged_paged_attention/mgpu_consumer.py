"""Compute warpgroups: wgmma Q K^T, online softmax in registers, wgmma P V, bulk-store of O rows.

fp8 pages (st.kv_fp8): the producer copies the 8-bit pages into 8-bit stages as it copies any
pages. P V is an fp8 x fp8 wgmma on the V stage itself: the pages store V transposed
(kv_layout.py), so the stage is [D, block_kv] with tokens contiguous, the K-major form fp8 wgmma
takes, and P is rounded to float8_e4m3fn (scaled by 2^PROBS_LOG2_SCALE so its small values stay
normal: the exponent of exp2 is shifted, and the shift cancels in O / denominator) and staged in
SMEM. V is never converted. For Q K^T, with tuning.fp8_qk (the default on fp8 pages) the wgmma
reads the 8-bit K stage itself (K-major as stored): each warpgroup quantizes its Q rows to e4m3
(one absmax scale per row, which joins the softmax scale per row; e4m3 on e5m2 pages too, a mixed
pair wgmma takes) into an 8-bit tile. Without it each
compute warpgroup converts a block of K to float16 in registers and stores it into its own
swizzled SMEM tile (dq_smem), which wgmma reads; with tuning.fp8_convert_early the next block's K
is converted while the tensor cores run this block's P V. float16 holds every e4m3 and e5m2
value exactly, and Q (bf16, converted once per item, |q| clamped to 65,504) as well as bf16 does
or better. The scales are not applied to K or V: k_scale joins the softmax scale and v_scale the
output's normalisation.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.ragged_paged_attention.mgpu_items import (
    Items,
    Refs,
    Statics,
    cdiv,
    for_each_item,
    tile_rows,
)
from pallas_kernels.ragged_paged_attention.mgpu_turns import NoTurns, make_turns
from pallas_kernels.ragged_paged_attention.reference import PROBS_LOG2_SCALE
from pallas_kernels.ragged_paged_attention.tuning import ROWS

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
WGMMA = plgpu.Layout.WGMMA
ROW_VEC = plgpu.Layout.WGMMA.reduce(1)  # one value per row of a WGMMA-layout tile


def _skip_blocks(st: Statics, r: Refs, kvc, n, turns: NoTurns) -> None:
    """Observe and release `n` K/V stages without computing on them, taking the turns that a
    computed block takes (mgpu_turns.py)."""

    def body(j, _):
        slot = lax.rem(kvc + j, st.tuning.num_stages)
        plgpu.barrier_wait(r.k_full.at[slot])
        plgpu.barrier_wait(r.v_full.at[slot])
        plgpu.barrier_arrive(r.kv_free.at[slot])
        turns.skip_block()
        return ()

    lax.fori_loop(0, n, body, ())


def _dequantize(st: Statics, src, dst) -> None:
    """An fp8 K block [bk, D] (a K stage) into dst [bk, D] (st.mma_dtype, swizzled SMEM), 64
    rows at a time, fenced for wgmma's reads."""
    for r0 in range(0, st.tuning.block_kv, ROWS):
        x = plgpu.load(src.at[pl.ds(r0, ROWS)], layout=WGMMA, optimized=False)
        dst.at[pl.ds(r0, ROWS)][...] = x.astype(st.mma_dtype)
    plgpu.commit_smem()


def _online_softmax(
    st: Statics, s, b, row_pos0, acc, m, denom, *, masked: bool, k_scale, q_scale=None,
    empty_rows=None,
):  # fmt: skip
    """One block's scores s [64, bk] f32 into P (st.p_dtype) with the running max m (log2
    units), the denominator and the accumulator rescaled; returns (p, acc, m_new, denom), p in
    st.p_dtype (fp8 pages: e4m3 scaled by 2^PROBS_LOG2_SCALE, and so are denom's new terms).
    k_scale: a scalar the scores are multiplied by (fp8 pages), or None. q_scale: [64] row
    scales the scores are multiplied by (an fp8 Q, tuning.fp8_qk), or None.

    With tuning.mma_row_sums, denom is the [64, 8] accumulator of P @ ones that _pv adds to
    (every column a row sum): only rescaled here, the sum itself is the tensor cores' work."""
    bk = st.tuning.block_kv
    # Scores in log2 units are s * to_log2. Without a soft cap the scale is not applied to s
    # itself: it is folded into the row max (scale > 0) and into exp2's argument, one FMA.
    scale = st.sm_scale if k_scale is None else st.sm_scale * k_scale

    def per_row(c):  # the scalar c, times each row's Q scale where Q is fp8
        if q_scale is None:
            return c
        return lax.broadcast_in_dim(q_scale * c, s.shape, [0])

    if st.soft_cap is not None:
        s = jnp.tanh(s * per_row(scale / st.soft_cap)) * (st.soft_cap * LOG2E)
        to_log2 = 1.0
        row_to_log2 = None
    else:
        to_log2 = per_row(scale * LOG2E)
        # the row max in log2 units: row scales are > 0, so they commute with the max
        row_to_log2 = None if q_scale is None else q_scale * (scale * LOG2E)
    if masked:
        rows = plgpu.broadcasted_iota(jnp.int32, (ROWS, bk), 0, layout=WGMMA)
        cols = plgpu.broadcasted_iota(jnp.int32, (ROWS, bk), 1, layout=WGMMA)
        visible = cols + b * bk <= row_pos0 + lax.div(rows, jnp.int32(st.group))
        s = jnp.where(visible, s, -jnp.inf)
    m_new = jnp.maximum(m, s.max(axis=1) * (to_log2 if row_to_log2 is None else row_to_log2))
    m_ref = m_new  # what exp2 subtracts
    if empty_rows is None:  # (decode items: as the launch's prefill forms)
        empty_rows = st.tuning.prefill_kv_splits > 1 or st.tuning.prefill_interleave is not False
    if masked and empty_rows:
        # A part of a split tile, or warpgroup 1's half of an interleaved tile (which starts at
        # its second block), may start past a row's position: the row sees no key so far,
        # m_new is -inf, and -inf - -inf would be NaN. Subtract 0 instead: alpha and p are 0,
        # and the row's log-sum-exp stays -inf (partial_merge.py, consumer.merge).
        m_ref = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp2(m - m_ref)
    # fp8 P: exp2 of (score - max + PROBS_LOG2_SCALE), in [0, 2^PROBS_LOG2_SCALE]; the same FMA
    shift = m_ref - PROBS_LOG2_SCALE if st.kv_fp8 else m_ref
    p = jnp.exp2(s * to_log2 - lax.broadcast_in_dim(shift, s.shape, [0]))
    if st.tuning.mma_row_sums:
        denom = denom * lax.broadcast_in_dim(alpha, denom.shape, [0])
    else:
        denom = denom * alpha + p.sum(axis=1)
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    return p.astype(st.p_dtype), acc, m_new, denom


def _v_chunks(st: Statics, stage) -> list:
    """An fp8 V^T stage [bk / v_chunk x D, v_chunk] as P V's B operands, one [v_chunk, D] per
    chunk of tokens (Statics.v_chunk)."""
    d = st.head_dim
    return [stage.at[pl.ds(c * d, d)].T for c in range(st.tuning.block_kv // st.v_chunk)]


def _pv(st: Statics, v, p, ones, acc, denom, meanwhile=None):
    """O += P V for one block, and with `ones` (mma_row_sums) the row sums += P @ ones on the
    tensor cores too; returns (acc, denom). p: registers (st.p_in_regs) or the SMEM tile it was
    staged in (fp8 P; interpret mode). v: a B operand, or (fp8 pages, _v_chunks) one per chunk
    of P's columns. a_operands "regs" (GPU): accumulated in place; "smem" (the form interpret
    mode runs): fresh products added. `meanwhile()`, if given, runs while the tensor cores
    compute."""
    with_sums = ones is not None

    def products(acc_ref, sums_ref):
        if isinstance(v, list):  # fp8 V^T chunks: each times its columns of P
            w = st.v_chunk
            for c, v_c in enumerate(v):
                plgpu.wgmma(acc_ref, p.at[:, pl.ds(c * w, w)], v_c)
        else:
            plgpu.wgmma(acc_ref, p, v)
        if with_sums:
            plgpu.wgmma(sums_ref, p, ones)
        if meanwhile is not None:
            meanwhile()

    if st.a_operands == "regs":

        def in_place(refs):
            products(refs[0], refs[1] if with_sums else None)

        inits = (acc, denom) if with_sums else (acc,)
        outs = pl.run_state(in_place)(tuple(map(plgpu.ACC.init, inits)))
        return outs[0], (outs[1] if with_sums else denom)

    def fresh(*refs):  # zero-initialised
        products(refs[0], refs[1] if with_sums else None)
        return tuple(ref[...] for ref in refs)

    shapes = [(ROWS, st.head_dim)] + ([(ROWS, 8)] if with_sums else [])
    outs = pl.run_scoped(fresh, *(plgpu.ACC(shape, jnp.float32) for shape in shapes))
    return acc + outs[0], (denom + outs[1] if with_sums else denom)


def _attend(
    st: Statics,
    r: Refs,
    q_op,
    p_smem,
    ones,
    dq,
    kvc,
    b_start,
    b_full,
    b_end,
    row_pos0,
    turns,
    q_scale=None,
    half=None,
    empty_rows=None,
):
    """Online-softmax attention of 64 query rows over K/V blocks [b_start, b_end) of the stream.

    q_op: Q [64, D], registers (WGMMA layout) or a swizzled SMEM ref (with tuning.fp8_qk an
    8-bit one, and q_scale its [64] row scales); p_smem: [64, bk] SMEM for P where it is not
    kept in registers (st.p_in_regs); ones: the [bk, 8] ones operand with tuning.mma_row_sums, or
    None; dq: this warpgroup's [bk, D] tile for K blocks dequantized from fp8 stages (converted
    just before their Q K^T, or with tuning.fp8_convert_early the next block's under this one's
    P V), or None. kvc: stream index of block b_start. Row r is at query position row_pos0 + r
    // group; blocks before b_full need no causal mask.
    turns: how this warpgroup takes turns on the tensor cores with the others (mgpu_turns.py).
    half: None (every block), or in an interleaved form (decode_interleave, prefill_interleave)
    an int32 scalar: -1 (every block), or h in {0, 1}: this warpgroup computes the blocks
    b_start + h, b_start + h + 2, ... and only waits for and releases the others.
    empty_rows: whether a row can meet a masked block before any key it sees (a part of a split
    tile, warpgroup 1's half of an interleaved one), whose -inf max is then guarded; None: as
    the launch's prefill forms need (decode items).
    Returns (acc [64, D] f32, m [64] running max in log2 units, denom [64] softmax denominator);
    with fp8 pages acc and denom are both 2^PROBS_LOG2_SCALE times their values (P's scale).
    The named scopes are the spans of Mosaic GPU's profiler (attention_profile.py); they cost
    nothing when it is off.
    """
    bk, stages, d = st.tuning.block_kv, st.tuning.num_stages, st.head_dim
    k_scale = r.kv_scales[0] if st.kv_fp8 else None
    # converted under the last P V (not where warpgroups may take every other block: the next
    # block would be the other's)
    early_k = dq is not None and st.tuning.fp8_convert_early and half is None

    def slot_of(b):
        return lax.rem(kvc + (b - b_start), stages)

    def k_operand(slot):  # a K stage as wgmma reads it: itself, or converted into dq
        if dq is None:
            return r.k_smem.at[slot]
        with jax.named_scope("dequantize"):
            _dequantize(st, r.k_smem.at[slot], dq)
        return dq

    def convert_k(b):  # block b's K, waited for and converted into the K tile
        with jax.named_scope("wait_k"):
            plgpu.barrier_wait(r.k_full.at[slot_of(b)])
        k_operand(slot_of(b))

    def block(b, carry, *, masked):
        if half is None:
            return compute_block(b, carry, masked=masked)

        def skip(carry):  # the other warpgroup's block: observed and released
            slot = slot_of(b)
            with jax.named_scope("skip"):
                plgpu.barrier_wait(r.k_full.at[slot])
                plgpu.barrier_wait(r.v_full.at[slot])
                plgpu.barrier_arrive(r.kv_free.at[slot])
            return carry

        mine = (half < 0) | (lax.rem(b - b_start, 2) == half)
        return lax.cond(mine, functools.partial(compute_block, b, masked=masked), skip, carry)

    def compute_block(b, carry, *, masked):
        acc, m, denom = carry
        slot = slot_of(b)
        if early_k:  # converted already: under the last block's P V, or before the first block
            k_op = dq
        else:
            with jax.named_scope("wait_k"):
                plgpu.barrier_wait(r.k_full.at[slot])
            k_op = k_operand(slot)

        def qk(s_ref):  # [64, bk] f32
            plgpu.wgmma(s_ref, q_op, k_op.T)
            turns.after_qk_issue()
            return s_ref[...]  # waits for the wgmma: the dq tile may then take the next K

        with jax.named_scope("qk"):
            s = pl.run_scoped(qk, plgpu.ACC((ROWS, bk), jnp.float32))
        with jax.named_scope("softmax"):
            p, acc, m_new, denom = _online_softmax(
                st, s, b, row_pos0, acc, m, denom, masked=masked, k_scale=k_scale,
                q_scale=q_scale, empty_rows=empty_rows,
            )  # fmt: skip
            if not st.p_in_regs:  # staged before V is waited for (and the turn handed over)
                p_smem[...] = p
                plgpu.commit_smem()
        with jax.named_scope("wait_v"):
            wait_v = lambda: plgpu.barrier_wait(r.v_full.at[slot])  # noqa: E731
            if st.p_in_regs:
                acc, m_new, denom, p = turns.before_pv(wait_v, (acc, m_new, denom, p))
            else:  # (a turn's optimization barrier carries no 8-bit registers: P is in SMEM)
                acc, m_new, denom = turns.before_pv(wait_v, (acc, m_new, denom))
                p = p_smem
        # fp8 pages: the stage is V^T in chunks of [D, v_chunk] tokens; each chunk's transpose
        # is a K-major B operand of P V
        v_op = _v_chunks(st, r.v_smem.at[slot]) if st.kv_fp8 else r.v_smem.at[slot]
        # (early: the next block's K into the K tile, which this block's Q K^T is done with)
        next_k = (lambda: pl.when(b + 1 < b_end)(lambda: convert_k(b + 1))) if early_k else None
        with jax.named_scope("pv"):
            acc, denom = _pv(st, v_op, p, ones, acc, denom, meanwhile=next_k)
        plgpu.barrier_arrive(r.kv_free.at[slot])
        return acc, m_new, denom

    acc = plgpu.layout_cast(jnp.zeros((ROWS, d), jnp.float32), WGMMA)
    m = plgpu.layout_cast(jnp.full((ROWS,), -jnp.inf, jnp.float32), ROW_VEC)
    if ones is None:
        denom = plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), ROW_VEC)
    else:
        denom = plgpu.layout_cast(jnp.zeros((ROWS, 8), jnp.float32), WGMMA)
    if early_k:
        pl.when(b_start < b_end)(lambda: convert_k(b_start))
    carry = lax.fori_loop(b_start, b_full, functools.partial(block, masked=False), (acc, m, denom))
    acc, m, denom = lax.fori_loop(b_full, b_end, functools.partial(block, masked=True), carry)
    if ones is not None:
        denom = denom.max(axis=1)  # every column holds the row sum: take one
    return acc, m, denom


def consumer(st: Statics, items: Items, cta, wg, r: Refs) -> None:
    g, bk, tpw, num_ctas = st.group, st.tuning.block_kv, st.tokens_per_wg, st.tuning.num_ctas
    splits = st.tuning.decode_splits
    # decode items of at least this many blocks are both compute warpgroups' (0: none)
    interleave = st.tuning.decode_interleave
    # both compute warpgroups on each prefill tile: always (True), in calls whose plan says so
    # (per_step: items.step_mix), or never
    static_mix = st.tuning.prefill_interleave is True
    per_step = st.tuning.prefill_per_step
    turns = make_turns(r.turn, wg)  # prefill tiles only (per_step: paired ones)
    p_smem = None if r.pa_smem is None else r.pa_smem.at[wg]
    # [WGS, bk, D]: this warpgroup's dequantized K tile (fp8 pages without fp8_qk)
    dq = None if r.dq_smem is None else r.dq_smem.at[wg]
    v_scale = r.kv_scales[1] if st.kv_fp8 else None
    ones = None
    if st.tuning.mma_row_sums:  # this warpgroup's ones operand, written once (mgpu_launch.py)
        r.ones_smem.at[wg][...] = plgpu.layout_cast(jnp.ones((ROWS, bk), st.p_dtype), WGMMA)
        plgpu.commit_smem()
        ones = r.ones_smem.at[wg, pl.ds(0, 8)].T  # [bk, 8]: 8 of its rows, K-major

    def load_q(qs, slot_wg):
        """Q rows of Q slot (qs, slot_wg) as this warpgroup's wgmma A operand (registers, or
        re-staged swizzled SMEM) and their row scales (an 8-bit Q, tuning.fp8_qk), else None."""
        q = plgpu.load(r.q_smem.at[qs, slot_wg], layout=WGMMA, optimized=False)
        if r.q8_smem is not None:  # each row over its absmax, into the 8-bit operand tile
            q = q.astype(jnp.float32)
            top = float(jnp.finfo(r.q8_smem.dtype).max)
            q_scale = jnp.maximum(jnp.abs(q).max(axis=1), 1e-30) * (1.0 / top)  # [64], > 0
            r.q8_smem.at[wg][...] = (q / lax.broadcast_in_dim(q_scale, q.shape, [0])).astype(
                r.q8_smem.dtype
            )
            plgpu.commit_smem()
            return r.q8_smem.at[wg], q_scale
        if q.dtype != st.mma_dtype:  # bf16 Q for float16 products with dequantized fp8 K
            top = float(jnp.finfo(st.mma_dtype).max)
            q = jnp.clip(q.astype(jnp.float32), -top, top).astype(st.mma_dtype)
        if st.a_operands == "regs":
            return q, None
        r.qa_smem.at[wg][...] = q
        plgpu.commit_smem()
        return r.qa_smem.at[wg], None

    def normalise(acc, denom):
        # Empty decode splits and parts, and the padding sequence's rows (no KV blocks at all,
        # schedule.with_padding_sequence): acc == 0, so O = 0.
        safe = jnp.maximum(denom, 1e-30)
        if v_scale is None:
            return acc / lax.broadcast_in_dim(safe, acc.shape, [0])
        return acc * lax.broadcast_in_dim(v_scale / safe, acc.shape, [0])

    # The hand-over of an interleaved item (decode_interleave, prefill_interleave, whose owner is
    # warpgroup 0): the non-owner stages its partial state in the one staging buffer and the
    # owner reads it. Barriers per owner, so that each has one kind of waiter: mix_full[o] only
    # owner o waits on, mix_free[o] (o's releases, and one arrival of o's at the start) only the
    # other. The buffer is free for a hand-over to either: a warpgroup writes it only after it
    # has read the last one handed to it, its items being in order.
    def hand_over(owner, acc, m, denom):
        plgpu.barrier_wait(r.mix_free.at[owner])
        r.mix_smem[...] = acc
        r.mix_stats.at[0][...] = m
        r.mix_stats.at[1][...] = denom
        plgpu.commit_smem()
        plgpu.barrier_arrive(r.mix_full.at[owner])

    def merge(owner, acc, m, denom):
        """The owner's partial state merged with the one handed over: both are softmax states
        over disjoint blocks, so each is rescaled to the larger row max."""
        plgpu.barrier_wait(r.mix_full.at[owner])
        acc1 = plgpu.load(r.mix_smem, layout=WGMMA, optimized=False)
        m1 = plgpu.load(r.mix_stats.at[0], layout=ROW_VEC, optimized=False)
        denom1 = plgpu.load(r.mix_stats.at[1], layout=ROW_VEC, optimized=False)
        plgpu.barrier_arrive(r.mix_free.at[owner])
        m_new = jnp.maximum(m, m1)
        # A row neither half saw a key of (a padding row, or the second half of an item of one
        # block): -inf - -inf would be NaN; its sums are 0 either way.
        m_ref = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha, alpha1 = jnp.exp2(m - m_ref), jnp.exp2(m1 - m_ref)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + acc1 * lax.broadcast_in_dim(
            alpha1, acc1.shape, [0]
        )
        return acc, m_new, denom * alpha + denom1 * alpha1

    def log2_sum_exp(m, denom):  # -inf for rows that saw no key
        # (fp8 pages: denom carries P's scale, 2^PROBS_LOG2_SCALE)
        shift = PROBS_LOG2_SCALE if st.kv_fp8 else 0
        return m + (jnp.log(denom) * (1.0 / LN2) - shift)

    def item_body(i, w, it, kvc):
        is_dec = items.is_decode(w)
        qs = lax.rem(i, 2)
        b0, b1 = it["b0"], it["b1"]

        owner = items.decode_owner(i)  # its Q slot and output are this warpgroup's
        mine = owner == wg
        if interleave:  # both warpgroups on an item of that many blocks
            mixed = b1 - b0 >= interleave
            takes, idle = mine | mixed, ~(mine | mixed)
        else:
            mixed, takes, idle = None, mine, ~mine

        def store_decode(acc, m, denom):
            with jax.named_scope("store_o"):
                o = normalise(acc, denom)
                if splits == 1:
                    r.q_smem.at[qs, owner][...] = o.astype(r.q_smem.dtype)
                    plgpu.commit_smem()
                    dst = r.out.at[0, it["tok0"], it["head"]]  # [G, D]
                    plgpu.copy_smem_to_gmem(r.q_smem.at[qs, owner, pl.ds(0, g)], dst)
                else:
                    stage = jnp.minimum(wg, st.tuning.decode_wgs - 1)  # this warpgroup's staging
                    o32, lse = r.o32_smem.at[stage], r.lse_smem.at[stage]
                    o32[...] = o
                    lse[...] = log2_sum_exp(m, denom)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(o32.at[pl.ds(0, g)], r.opart.at[w])
                    plgpu.copy_smem_to_gmem(lse, r.lse.at[w])
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            plgpu.barrier_arrive(r.qd_free.at[qs])

        @pl.when(is_dec & takes)
        def _decode():
            # Per-item spans beside the per-block ones (attention_profile.py): the wait for this
            # item's Q, its load (and quantization), and the output's normalisation and store.
            with jax.named_scope("wait_q"):
                plgpu.barrier_wait(r.qd_full.at[qs])
            with jax.named_scope("load_q"):
                q, q_scale = load_q(qs, owner)
            if interleave:  # the other has read the slot: its release (the owner's: its store)
                pl.when(~mine)(lambda: plgpu.barrier_arrive(r.qd_free.at[qs]))
            row_pos0 = it["kv_len"] - 1
            b_full = jnp.clip(lax.div(row_pos0 + 1, jnp.int32(bk)), b0, b1)
            args = (kvc, b0, b_full, b1, row_pos0, NoTurns(), q_scale)
            # the owner computes blocks b0, b0 + 2, ..., the other b0 + 1, ...; -1: all
            half = jnp.where(mixed, jnp.where(mine, 0, 1), -1) if interleave else None
            acc, m, denom = _attend(st, r, q, p_smem, ones, dq, *args, half=half)
            if not interleave:
                store_decode(acc, m, denom)
                return
            pl.when(~mixed)(lambda: store_decode(acc, m, denom))  # (the owner: only it is here)
            with jax.named_scope("mix"):  # the other hands its half over, the owner merges
                pl.when(mixed & ~mine)(lambda: hand_over(owner, acc, m, denom))
            pl.when(mixed & mine)(lambda: store_decode(*merge(owner, acc, m, denom)))

        @pl.when(is_dec & idle)
        def _decode_idle():  # the other warpgroup's item: its blocks waited for and released
            if interleave:  # every warpgroup observes every completion of a Q slot's barrier,
                # and releases the slot, so that the producer cannot fill it again (and complete
                # its barrier once more) before this warpgroup has seen it filled: short items
                # (empty decode splits, items within the pipeline's depth) would let it run
                # two completions ahead
                plgpu.barrier_wait(r.qd_full.at[qs])
                plgpu.barrier_arrive(r.qd_free.at[qs])
            with jax.named_scope("skip"):
                _skip_blocks(st, r, kvc, b1 - b0, NoTurns())

        def prefill(interleaved: bool, box, turns):
            """A prefill tile in one static form: `interleaved` (both warpgroups on its one box,
            every other block each) or one box per warpgroup; `box`: this warpgroup's Q box in
            the slot."""
            with jax.named_scope("wait_q"):
                plgpu.barrier_wait(r.qp_full.at[qs])
            turns.item_start()
            first_tok = it["tok0"] + (0 if interleaved else wg * tpw)  # its box's first token
            start = tile_rows(st, first_tok)  # token of row 0 (== first_tok unless clamped)
            n_tok = jnp.clip(it["seq_end"] - first_tok, 0, tpw)
            pos_offset = it["kv_len"] - it["q_len"] - it["seq_start"]  # position = token + offset
            first_pos = first_tok + pos_offset
            b_end = jnp.where(n_tok > 0, jnp.clip(cdiv(first_pos + n_tok, bk), b0, b1), b0)
            if interleaved:  # both warpgroups on a tile of two blocks or more; else wg 0 alone
                mixed = b_end - b0 >= 2
                active = (n_tok > 0) & (mixed | (wg == 0))
            else:
                mixed, active = None, n_tok > 0
            b_stop = jnp.where(active, b_end, b0)  # this warpgroup's blocks end here

            def epilogue(acc, m, denom):
                with jax.named_scope("store_o"):  # the epilogue, to the stores' end
                    r.q_smem.at[qs, box][...] = normalise(acc, denom).astype(r.q_smem.dtype)
                    if r.part_lse is not None:
                        r.part_lse_smem.at[wg][...] = log2_sum_exp(m, denom)
                    plgpu.commit_smem()
                    part = it["part_index"]  # 0 unless the tile is split
                    out_part = r.out.at[part]  # [T, Hkv, G, D]

                    if r.part_lse is not None:

                        @pl.when(it["part_count"] > 1)  # the merge weighs this part's rows by it
                        def _store_lse():
                            row = it["tile"] * st.tuning.prefill_boxes + box
                            dst = r.part_lse.at[part, it["head"], row]  # [64]
                            plgpu.copy_smem_to_gmem(r.part_lse_smem.at[wg], dst)

                    # Token by token ([G, D] each): rows of the Q box before first_tok (a clamped
                    # box) belong to other tiles.
                    def store(k, _):
                        src = r.q_smem.at[qs, box, pl.ds((first_tok - start + k) * g, g)]  # [G, D]
                        plgpu.copy_smem_to_gmem(src, out_part.at[first_tok + k, it["head"]])
                        return ()

                    lax.fori_loop(0, n_tok, store, ())
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

            @pl.when(active)
            def _compute():
                with jax.named_scope("load_q"):
                    q, q_scale = load_q(qs, box)
                b_full = jnp.clip(lax.div(first_pos + 1, jnp.int32(bk)), b0, b_end)
                row_pos0 = start + pos_offset
                # interleaved: warpgroup h computes blocks b0 + h, b0 + h + 2, ...; -1: all
                half = jnp.where(mixed, wg, -1) if interleaved else None
                args = (kvc, b0, b_full, b_end, row_pos0, turns, q_scale)
                # Rows with no key yet: a part of a split tile, or warpgroup 1's half of an
                # interleaved tile (_online_softmax).
                empty_rows = interleaved or st.tuning.prefill_kv_splits > 1
                acc, m, denom = _attend(
                    st, r, q, p_smem, ones, dq, *args, half=half, empty_rows=empty_rows
                )
                if not interleaved:
                    epilogue(acc, m, denom)
                    return
                pl.when(~mixed)(lambda: epilogue(acc, m, denom))  # (warpgroup 0: only it is here)
                with jax.named_scope("mix"):  # warpgroup 1 hands its half over, 0 merges
                    pl.when(mixed & (wg == 1))(lambda: hand_over(0, acc, m, denom))
                pl.when(mixed & (wg == 0))(lambda: epilogue(*merge(0, acc, m, denom)))

            _skip_blocks(st, r, kvc + (b_stop - b0), b1 - b_stop, turns)
            turns.item_end()
            plgpu.barrier_arrive(r.qp_free.at[qs])

        if per_step:  # each form's own code, as the static forms have it (no per-block tests)
            # (the producer copies an interleaved tile's box into both: each reads its own)
            pl.when(items.is_prefill(w) & items.step_mix)(lambda: prefill(True, wg, NoTurns()))
            pl.when(items.is_prefill(w) & items.step_paired)(lambda: prefill(False, wg, turns))
        else:
            pl.when(~is_dec)(lambda: prefill(static_mix, 0 if static_mix else wg, turns))

        return kvc + (b1 - b0)

    keys = ("head", "tok0", "kv_len", "q_len", "seq_start", "seq_end", "b0", "b1")
    keys += ("part_index", "part_count", "tile")
    if st.tuning.hands_over:  # the first hand-over to this warpgroup finds the staging free
        plgpu.barrier_arrive(r.mix_free.at[wg])
    for_each_item(items, cta, num_ctas, keys, item_body, jnp.int32(0))
    if st.tuning.hands_over:  # observe the other's last release (or its first arrival, if none)
        plgpu.barrier_wait(r.mix_free.at[1 - wg])
