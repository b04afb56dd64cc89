"""Launch of the Mosaic GPU kernel: scratch buffers, barriers, persistent grid."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.ragged_paged_attention.mgpu_kernel import Statics, attention_kernel
from pallas_kernels.ragged_paged_attention.reference import QUERY_DTYPE
from pallas_kernels.ragged_paged_attention.tuning import ROWS


def _mma_transforms(row_elems: int, dtype) -> tuple:
    """wgmma operand layout in SMEM for rows of `row_elems`: (8, swizzle/itemsize) tiles,
    swizzled by the largest of 128, 64, 32 bytes that divides a row."""
    row_bytes = row_elems * jnp.dtype(dtype).itemsize
    swizzle = next(s for s in (128, 64, 32) if row_bytes % s == 0)
    elems = swizzle // jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(swizzle))


PROFILE_SPANS = 1024  # per warpgroup: 16 bytes each, in SMEM beside the kernel's buffers


def profile_smem_bytes(tn) -> int:
    return PROFILE_SPANS * 16 * (tn.compute_wgs + 1)


def launch(
    st: Statics,
    meta: jax.Array,  # int32[META_SIZE]
    kv_lens: jax.Array,  # int32[S]
    cu_q_lens: jax.Array,  # int32[S + 1]
    page_table: jax.Array,  # int32[S, MP]
    parts: jax.Array,  # int32[MT * K, PART_COLUMNS]   (schedule.prefill_parts)
    q: jax.Array,  # [T, Hkv, G, D]   the step's [T, Hq, D] queries (q head kv_head * G + g)
    kv_pages: jax.Array,  # [P, Hkv, 2, PS, D]
    kv_values: jax.Array | None,  # kv_layout.values_view(kv_pages) for fp8 pages, else None
    kv_scales: jax.Array | None,  # f32[2] for fp8 pages (st.kv_fp8), else None
    *,
    interpret,
    profile_dir: str | None = None,
) -> tuple[jax.Array, jax.Array | None, jax.Array | None, jax.Array | None]:
    """Runs the kernel; returns (out [K, *q.shape], split decode partials or None, their lse or
    None, split prefill parts' lse f32[K, Hkv, MT * WGS, 64] or None); K is
    tuning.prefill_kv_splits, and out[k] holds the k-th parts of split prefill tiles (out[0]
    everything else).

    profile_dir: record Mosaic GPU profiler spans (mgpu_consumer's named scopes, PROFILE_SPANS
    per warpgroup, the rest dropped) and write one trace per call there.
    """
    tn = st.tuning
    d = st.head_dim
    wgs = tn.compute_wgs
    num_seqs = kv_lens.shape[0]
    dtype = q.dtype  # Q in, O out
    mma_dtype = st.mma_dtype  # wgmma operands
    kv_dtype = kv_pages.dtype
    split = tn.decode_splits > 1
    dec_parts = num_seqs * st.num_kv_heads * tn.decode_splits
    k = tn.prefill_kv_splits
    max_tiles = parts.shape[0] // k
    out_types = [
        jax.ShapeDtypeStruct((k, *q.shape), dtype),
        jax.ShapeDtypeStruct((dec_parts, st.group, d), jnp.float32) if split else None,
        jax.ShapeDtypeStruct((dec_parts, ROWS), jnp.float32) if split else None,
        jax.ShapeDtypeStruct((k, st.num_kv_heads, max_tiles * tn.prefill_boxes, ROWS), jnp.float32)
        if k > 1
        else None,
    ]
    copies_per_block = st.pages_per_block if st.page_size <= tn.block_kv else 1
    mma = _mma_transforms(d, mma_dtype)
    kv_tiles = _mma_transforms(d, kv_dtype)
    a_smem = st.a_operands == "smem"
    p_dtype = st.p_dtype
    p_tiles = _mma_transforms(tn.block_kv, p_dtype)
    if st.kv_fp8:  # V^T stages in chunks [bk / v_chunk x D, v_chunk] (Statics.v_chunk)
        v_stage = (tn.num_stages, tn.block_kv // st.v_chunk * d, st.v_chunk)
        v_tiles = _mma_transforms(st.v_chunk, kv_dtype)
        p_tiles = v_tiles  # one wgmma swizzles both operands alike (and the ones of row sums)
    else:
        v_stage, v_tiles = (tn.num_stages, tn.block_kv, d), kv_tiles
    scratch = [
        plgpu.SMEM((tn.num_stages, tn.block_kv, d), kv_dtype, transforms=kv_tiles),  # k_smem
        plgpu.SMEM(v_stage, kv_dtype, transforms=v_tiles),  # v_smem
        plgpu.SMEM((2, wgs, ROWS, d), dtype),  # q_smem
        plgpu.SMEM((wgs, ROWS, d), mma_dtype, transforms=mma) if a_smem else None,  # qa_smem
        None
        if st.p_in_regs
        else plgpu.SMEM((wgs, ROWS, tn.block_kv), p_dtype, transforms=p_tiles),  # pa_smem
        plgpu.SMEM((tn.decode_wgs, ROWS, d), jnp.float32) if split else None,  # o32_smem
        plgpu.SMEM((tn.decode_wgs, ROWS), jnp.float32) if split else None,  # lse_smem
        # ones_smem: wgmma's B operand of P @ ones uses 8 rows; a register array stores 64.
        plgpu.SMEM((wgs, ROWS, tn.block_kv), p_dtype, transforms=p_tiles)
        if tn.mma_row_sums
        else None,
        plgpu.SMEM((wgs, ROWS), jnp.float32) if tn.prefill_kv_splits > 1 else None,  # part_lse
        # dq_smem: each compute warpgroup's block of K dequantized for wgmma (fp8 pages
        # without fp8_qk)
        plgpu.SMEM((wgs, tn.block_kv, d), mma_dtype, transforms=mma)
        if st.kv_fp8 and not tn.fp8_qk
        else None,
        # q8_smem: each compute warpgroup's Q rows in e4m3 (reference.QUERY_DTYPE), Q K^T's A
        # operand (fp8_qk)
        plgpu.SMEM((wgs, ROWS, d), QUERY_DTYPE, transforms=_mma_transforms(d, QUERY_DTYPE))
        if st.kv_fp8 and tn.fp8_qk
        else None,
        # mix_smem, mix_stats: a compute warpgroup's partial O, row max and denominator of an
        # interleaved item, for the item's owner to merge (tuning.hands_over)
        plgpu.SMEM((ROWS, d), jnp.float32) if tn.hands_over else None,
        plgpu.SMEM((2, ROWS), jnp.float32) if tn.hands_over else None,
        plgpu.Barrier(num_arrivals=copies_per_block, num_barriers=tn.num_stages),  # k_full
        plgpu.Barrier(num_arrivals=copies_per_block, num_barriers=tn.num_stages),  # v_full
        plgpu.Barrier(num_arrivals=wgs, num_barriers=tn.num_stages),  # kv_free
        plgpu.Barrier(num_arrivals=1, num_barriers=2),  # qd_full
        # qp_full: one copy per token of each Q box
        plgpu.Barrier(num_arrivals=st.tokens_per_tile, num_barriers=2),
        # qd_free: the owner's store; with decode_interleave also the other compute warpgroup's
        # arrival once it has seen the slot filled (mgpu_consumer.consumer: it waits on every
        # qd_full completion, so the producer must not fill the slot again before it has)
        plgpu.Barrier(num_arrivals=2 if tn.decode_interleave else 1, num_barriers=2),
        plgpu.Barrier(num_arrivals=wgs, num_barriers=2),  # qp_free
        plgpu.Barrier(num_arrivals=2) if tn.pingpong else None,  # turn (mgpu_turns.py)
        # mix_full, mix_free: one each per owner (the hand-over's direction)
        plgpu.Barrier(num_arrivals=1, num_barriers=2) if tn.hands_over else None,
        plgpu.Barrier(num_arrivals=1, num_barriers=2) if tn.hands_over else None,
    ]
    kernel = plgpu.kernel(
        functools.partial(attention_kernel, st=st),
        out_type=out_types,
        scratch_types=scratch,
        grid=(tn.num_ctas,),
        grid_names=("cta",),
        num_threads=wgs + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            approx_math=True,
            profile_space=PROFILE_SPANS if profile_dir else 0,
            profile_dir=profile_dir or "",
            profile_bounds_check=True,
        ),
        interpret=interpret,
    )
    args = (meta, kv_lens, cu_q_lens, page_table, parts, q, kv_pages, kv_values, kv_scales)
    return tuple(kernel(*args))
