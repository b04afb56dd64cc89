"""Mosaic GPU kernel body: persistent, warp-specialised ragged paged attention (Hopper).

Per CTA: `tuning.compute_wgs` compute warpgroups and one producer warpgroup. Both roles walk the
same list of work items (schedule.py; a CTA's share: mgpu_items.snake_item) with the same block
counts, so they agree on every pipeline slot without talking except through barriers:

    producer (mgpu_producer.py): per item, bulk-copy its Q rows into a Q slot (2 slots, one item
        ahead), then per KV block one TMA per page for K and one for V into a K/V stage;
        one thread issues them all, or (tuning.producer_warps == 4) the warpgroup's warps share
        the K/V copies.
    compute (mgpu_consumer.py): per item, load its 64 Q rows, then per KV block
        S = Q K^T (wgmma, M = 64 rows, N = block_kv), online softmax in registers,
        O += P V (wgmma, P from registers; fp8 pages: an e4m3 P from SMEM times the 8-bit V^T
        stage); normalise, stage O in the Q slot, bulk-store its rows
        (a part of a split prefill tile: into its part's output, with its rows' log-sum-exp).

Decode items are computed by one compute warpgroup, `Items.decode_owner`: warpgroup 0, or (with
tuning.decode_wgs == 2) warpgroups 0 and 1 in turn; the others just wait on and release their K/V
stages (every waiter must observe every completion of a barrier). With tuning.decode_interleave
both compute warpgroups take the decode items of at least that many blocks, every other block
each, and the owner merges the two partial results. A prefill tile gives each
compute warpgroup `tokens_per_wg` tokens x `group` heads = up to 64 rows; all share the K/V
stream and, with tuning.pingpong, take turns on the tensor cores (mgpu_turns.py). With
tuning.prefill_interleave a tile is one such box of 64 rows, both compute warpgroups take every
other block of it, and warpgroup 0 merges and stores.

Rows of a tile that hold no valid (token, head) pair contain garbage: attention is row-independent
and such rows are never stored. Masked scores are -inf; every valid row sees key 0 in its first
block, so its running max is finite from the first block on.
"""

from __future__ import annotations

from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.ragged_paged_attention.mgpu_consumer import consumer
from pallas_kernels.ragged_paged_attention.mgpu_items import Items, Refs, Statics
from pallas_kernels.ragged_paged_attention.mgpu_producer import producer

__all__ = ["Statics", "attention_kernel"]


def attention_kernel(
    meta_ref,  # int32[META_SIZE]              GMEM
    kv_lens_ref,  # int32[S]                   GMEM
    cu_ref,  # int32[S + 1]                    GMEM
    pt_ref,  # int32[S, MP]                    GMEM, MP a multiple of pages_per_block
    parts_ref,  # int32[MP, PART_COLUMNS]      GMEM, prefill parts in order (schedule.py)
    q_ref,  # [T, Hkv, G, D]                   GMEM, [T, Hq, D] reshaped (q head kv_head * G + g)
    kv_ref,  # [P, Hkv, 2, PS, D]              GMEM
    kv_values_ref,  # [P, Hkv, 2, D, PS]       GMEM, kv_ref's buffer (kv_layout.values_view): V^T
    #                                          of fp8 pages is read through it; else None
    kv_scales_ref,  # f32[2]                   GMEM (k_scale, v_scale of fp8 pages) or None
    out_ref,  # [K, T, Hkv, G, D]              GMEM, q_ref's layout per prefill part index (K:
    #                                          tuning.prefill_kv_splits; decode rows in [0])
    opart_ref,  # f32[S*Hkv*splits, G, D]      GMEM (split decode partials) or None
    lse_ref,  # f32[S*Hkv*splits, 64]          GMEM (their log2-sum-exp) or None
    part_lse_ref,  # f32[K, Hkv, MT * WGS, 64] GMEM (log2-sum-exp of split tiles' parts) or None
    k_smem,  # [stages, bk, D]                 SMEM, tiled + swizzled (the pages' dtype)
    v_smem,  # [stages, bk, D]                 SMEM, tiled + swizzled (the pages' dtype); fp8
    #                                          pages: V^T [stages, D, bk]
    q_smem,  # [2, WGS, 64, D]                 SMEM, Q in, O out (two item slots)
    qa_smem,  # [WGS, 64, D]                   SMEM, swizzled Q operand, or None (a_operands="regs")
    pa_smem,  # [WGS, 64, bk]                  SMEM, swizzled P operand (st.p_dtype), or None
    #                                          (st.p_in_regs)
    o32_smem,  # f32[decode_wgs, 64, D]        SMEM (split decode only) or None
    lse_smem,  # f32[decode_wgs, 64]           SMEM (split decode only) or None
    ones_smem,  # [WGS, 64, bk]                SMEM, ones (tuning.mma_row_sums) or None
    part_lse_smem,  # f32[WGS, 64]             SMEM (prefill_kv_splits > 1) or None
    dq_smem,  # [WGS, bk, D] mma dtype         SMEM, swizzled: K blocks dequantized from fp8
    #                                          stages (fp8 pages without tuning.fp8_qk), or None
    q8_smem,  # [WGS, 64, D] e4m3              SMEM, swizzled: each warpgroup's Q rows quantized
    #                                          (reference.QUERY_DTYPE; tuning.fp8_qk), or None
    mix_smem,  # f32[64, D]                    SMEM, the non-owner's partial O of a decode item
    mix_stats,  # f32[2, 64]                   SMEM, its row max and denominator
    #                                          (tuning.decode_interleave), or None
    k_full,  # barrier[stages], one arrival per K copy of a block
    v_full,  # barrier[stages]
    kv_free,  # barrier[stages], WGS arrivals (WGS: tuning.compute_wgs)
    qd_full,  # barrier[2], decode Q landed
    qp_full,  # barrier[2], prefill Q landed (one copy per token of each compute warpgroup)
    qd_free,  # barrier[2], decode Q slot released
    qp_free,  # barrier[2], prefill Q slot released (WGS arrivals)
    turn,  # barrier, 2 arrivals: prefill ping-pong rendezvous (mgpu_turns.py), or None
    mix_full,  # barrier[2], per owner: the other's state staged (decode_interleave), or None
    mix_free,  # barrier[2], per owner: the owner has read it, or None
    *,
    st: Statics,
):
    wg = lax.axis_index("wg")
    cta = lax.axis_index("cta")
    r = Refs(meta_ref, kv_lens_ref, cu_ref, pt_ref, parts_ref, q_ref, kv_ref, kv_values_ref,
             kv_scales_ref,
             out_ref, opart_ref, lse_ref, part_lse_ref, k_smem, v_smem, q_smem, qa_smem, pa_smem,
             o32_smem, lse_smem, ones_smem, part_lse_smem, dq_smem, q8_smem, mix_smem,
             mix_stats, k_full, v_full, kv_free, qd_full, qp_full, qd_free, qp_free, turn,
             mix_full, mix_free)  # fmt: skip
    items = Items(st, r)

    wgs = st.tuning.compute_wgs

    @pl.when(wg < wgs)
    def _compute_wg():
        plgpu.set_max_registers(st.tuning.compute_registers, action="increase")
        consumer(st, items, cta, wg, r)

    @pl.when(wg == wgs)
    def _producer_wg():
        plgpu.set_max_registers(st.tuning.producer_registers, action="decrease")
        producer(st, items, cta, r)
