"""The Mosaic GPU kernel lowers for CUDA here, on the CPU machine, in each tuning form the GPU
benchmark can ask for: Mosaic GPU's lowering runs in Python (layouts, TMA shapes, barriers), so
CI catches what interpret mode cannot; only the final PTX compile needs the GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from kernel_cases import abstract_args

from pallas_kernels.ragged_paged_attention.pallas_attention import ragged_paged_attention_pallas
from pallas_kernels.ragged_paged_attention.tuning import TuningConfig

# default_tuning's head_dim-64 prefill schedule where a bucket has fewer tiles than SMs
PREFILL_64_SPLIT = dict(
    compute_wgs=3, decode_wgs=2, producer_warps=4, mma_row_sums=True, prefill_kv_splits=4
)


# both compute warpgroups on decode items of 4 blocks and more, with a decode bucket's fields
INTERLEAVE = dict(decode_interleave=4, decode_wgs=2, pingpong=True, producer_warps=4)
# both compute warpgroups on every prefill tile, with a short-chunk bucket's other fields
PREFILL_INTERLEAVE = dict(prefill_interleave=True, decode_wgs=2, producer_warps=4)
# interleaved or paired tiles (with ping-pong) as each call's plan picks
PER_STEP = dict(prefill_interleave="per_step", decode_wgs=2, producer_warps=4, pingpong=True)


@pytest.mark.parametrize(
    "tuning, head_dim",
    [
        (TuningConfig(64, 3, 1, 132), 128),
        (TuningConfig(64, 2, 2, 132, decode_wgs=2), 128),
        (TuningConfig(64, 3, 1, 132, decode_wgs=2), 128),
        (TuningConfig(128, 2, 1, 132, pingpong=True), 128),
        (TuningConfig(128, 2, 1, 132, decode_wgs=2, pingpong=True, producer_warps=4), 128),
        (TuningConfig(128, 3, 1, 132, compute_wgs=3, decode_wgs=2, producer_warps=4), 64),
        (
            TuningConfig(
                128, 2, 1, 132, compute_wgs=3, decode_wgs=2, producer_warps=4, mma_row_sums=True
            ),
            64,
        ),
        (TuningConfig(128, 2, 1, 132, **PREFILL_64_SPLIT), 64),
        (TuningConfig(64, 3, 1, 132, **INTERLEAVE), 128),
        (TuningConfig(64, 2, 2, 132, decode_interleave=1), 128),
        (TuningConfig(128, 3, 1, 132, **PREFILL_INTERLEAVE), 64),
        (TuningConfig(64, 3, 1, 132, **PREFILL_INTERLEAVE), 128),
        (TuningConfig(128, 2, 1, 132, **PREFILL_INTERLEAVE, mma_row_sums=True), 64),
        (TuningConfig(128, 3, 1, 132, **PER_STEP), 64),
    ],
    ids=[
        "default-form",
        "decode-wgs-2-split",
        "decode-wgs-2",
        "pingpong",
        "producer-warps-4",
        "compute-wgs-3",
        "mma-row-sums",
        "prefill-kv-splits",
        "decode-interleave",
        "decode-interleave-split",
        "prefill-interleave",
        "prefill-interleave-head-dim-128",
        "prefill-interleave-row-sums",
        "prefill-interleave-per-step",
    ],
)
def test_kernel_lowers_for_cuda(tuning, head_dim):
    """32 q / 8 kv heads, page 16, bf16: the headline decode layout (head_dim 128), and head_dim
    64 where a form needs it."""
    args = abstract_args(tokens=64, pages=256, seqs=16, pages_per_seq=64, head_dim=head_dim)
    traced = ragged_paged_attention_pallas.trace(
        *args, sm_scale=head_dim**-0.5, tuning=tuning, interpret=False
    )
    assert "mosaic_gpu" in traced.lower(lowering_platforms=("cuda",)).as_text()


# the fields default_tuning gives an fp8 decode bucket besides its block (tuning.RULES)
FP8_DECODE = dict(decode_wgs=2, pingpong=True, producer_warps=4, fp8_convert_early=True)


# fp8 pages store V transposed (kv_layout.py): the V^T stage's swizzle follows the page when a
# block spans several pages (32 -> 32 bytes, 64 -> 64) and the block when one page holds several
# blocks (256-token pages).
@pytest.mark.parametrize(
    "tuning, head_dim, kv_dtype, page_size",
    [
        (
            TuningConfig(128, 2, 1, 132, decode_wgs=2, pingpong=True, producer_warps=4),
            *(128, "e4m3", 64),
        ),
        (TuningConfig(64, 3, 2, 132), 128, "e5m2", 32),  # split decode
        (
            TuningConfig(
                128, 2, 1, 132, compute_wgs=3, decode_wgs=2, producer_warps=4, mma_row_sums=True
            ),
            *(64, "e4m3", 256),
        ),
        (TuningConfig(128, 2, 1, 132, pingpong=True), 32, "e5m2", 64),
        (
            TuningConfig(64, 2, 1, 132, decode_wgs=2, pingpong=True, fp8_convert_early=True),
            *(128, "e4m3", 32),
        ),
        # default_tuning's fp8 decode schedules (tuning.BLOCKS "fp8 decode, ...")
        (TuningConfig(128, 6, 1, 132, **FP8_DECODE), 64, "e5m2", 64),
        (TuningConfig(64, 5, 1, 132, **FP8_DECODE), 128, "e5m2", 64),
        # Q K^T on the 8-bit K stage (fp8_qk): an fp8 Q tile, fp8 x fp8 wgmma
        (TuningConfig(128, 6, 1, 132, **FP8_DECODE, fp8_qk=True), 64, "e4m3", 64),
        (TuningConfig(64, 6, 1, 132, **FP8_DECODE, fp8_qk=True), 128, "e4m3", 64),
        # the same with both compute warpgroups on every decode item
        (TuningConfig(128, 6, 1, 132, **INTERLEAVE, fp8_qk=True), 64, "e4m3", 64),
        (TuningConfig(128, 6, 1, 132, **INTERLEAVE, fp8_convert_early=True), 64, "e5m2", 64),
        (TuningConfig(128, 2, 1, 132, **PREFILL_INTERLEAVE, fp8_qk=True), 64, "e4m3", 64),
        (
            TuningConfig(
                *(128, 2, 1, 132),
                compute_wgs=3,
                decode_wgs=2,
                producer_warps=4,
                mma_row_sums=True,
                fp8_convert_early=True,
                fp8_qk=True,
            ),
            *(64, "e5m2", 32),
        ),
        # default_tuning's e4m3 prefill schedules (bf16's blocks, fp8 Q K^T)
        (TuningConfig(128, 2, 1, 132, **FP8_DECODE, fp8_qk=True), 128, "e4m3", 64),
        (
            TuningConfig(128, 2, 1, 132, **PREFILL_64_SPLIT, fp8_convert_early=True, fp8_qk=True),
            *(64, "e4m3", 64),
        ),
    ],
    ids=[
        "default-form-e4m3",
        "split-decode-e5m2-page-32",
        "compute-wgs-3-e4m3-page-256",
        "head-dim-32-e5m2",
        "convert-early-e4m3-page-32",
        "fp8-decode-default-head-dim-64-e5m2",
        "fp8-decode-default-head-dim-128-e5m2",
        "fp8-decode-default-head-dim-64-e4m3",
        "fp8-decode-default-head-dim-128-e4m3",
        "fp8-decode-interleave-head-dim-64-e4m3",
        "fp8-decode-interleave-head-dim-64-e5m2",
        "fp8-prefill-interleave-head-dim-64-e4m3",
        "fp8-qk-early-compute-wgs-3-e5m2-page-32",
        "fp8-prefill-default-head-dim-128",
        "fp8-prefill-default-head-dim-64-splits",
    ],
)
def test_fp8_kernel_lowers_for_cuda(tuning, head_dim, kv_dtype, page_size):
    """fp8 pages: 8-bit stages (V^T's copies into columns of its stage), P V as an e4m3 x fp8
    wgmma on the V^T stage, K's float16 dequantization in registers or fp8 Q K^T (Mosaic GPU's
    layouts, transforms and conversions are checked here), the scales read from GMEM."""
    dtype = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}[kv_dtype]
    args = abstract_args(
        *(),
        tokens=64,
        pages=256,
        seqs=16,
        pages_per_seq=max(4, 1024 // page_size),
        head_dim=head_dim,
        kv_dtype=dtype,
        page_size=page_size,
    )
    traced = ragged_paged_attention_pallas.trace(
        *args,
        sm_scale=head_dim**-0.5,
        kv_scales=jax.ShapeDtypeStruct((2,), jnp.float32),
        tuning=tuning,
        interpret=False,
    )
    assert "mosaic_gpu" in traced.lower(lowering_platforms=("cuda",)).as_text()
