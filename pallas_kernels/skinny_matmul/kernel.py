"""The Mosaic GPU kernel: each CTA streams a [128 rows, K / splits] slice of the weight through a
warp-specialized TMA pipeline and multiplies it with the same slice of the tokens.

Few tokens leave wgmma's 64-row side to the weight: each compute warpgroup owns 64 weight rows
(output features) as operand A and takes the tokens as operand B (wgmma's N is the token count,
8 to 256), accumulating out^T [64, T] in float32. A weight stored [out, in] is K-major as it
stands (the only layout fp8 wgmma takes); a float kernel stored [in, out] is read transposed,
which wgmma allows for 16-bit types. The tokens are K-major in both. Each CTA writes its partial
sums to partials[split, rows, T]; the caller adds the splits (api.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.skinny_matmul.tuning import ROWS, SkinnyTuning, epilogue_tokens

WG_ROWS = 64  # wgmma's M: the weight rows of one compute warpgroup
COMPUTE_WGS = ROWS // WG_ROWS
MEMORY_REGISTERS = 40  # the TMA-issuing warpgroup needs few; the compute warpgroups get the rest


def _transforms(row_bytes: int, dtype) -> tuple:
    """wgmma's operand layout in SMEM: (8, swizzle / itemsize) tiles, swizzled."""
    swizzle = next(s for s in (128, 64, 32) if row_bytes % s == 0)
    elems = swizzle // jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(swizzle))


def _kernel(
    w_gmem, x_gmem, partials_gmem, out_smem, a_smem=None, *, tn, w_layout, num_tokens, k_per_split
):
    # w_gmem: [N, K] (out_in) or [K, N] (in_out)     x_gmem: [T, K]
    # partials_gmem: f32[splits, N, T]
    # out_smem: f32[COMPUTE_WGS, 2 slots, 64, epilogue_tokens(T)]
    # a_smem: x.dtype[COMPUTE_WGS, 64, bk] (int8 weights in interpret mode) or None
    out_in = w_layout == "out_in"
    bk = tn.block_k
    w_item = jnp.dtype(w_gmem.dtype).itemsize
    x_item = jnp.dtype(x_gmem.dtype).itemsize
    if out_in:  # [ROWS, bk] blocks, K contiguous
        w_spec = plgpu.BlockSpec(
            (ROWS, bk), lambda k: (0, k), transforms=_transforms(bk * w_item, w_gmem.dtype)
        )
    else:  # [bk, ROWS] blocks, the rows contiguous
        w_spec = plgpu.BlockSpec(
            (bk, ROWS), lambda k: (k, 0), transforms=_transforms(ROWS * w_item, w_gmem.dtype)
        )
    x_spec = plgpu.BlockSpec(
        (num_tokens, bk), lambda k: (0, k), transforms=_transforms(bk * x_item, x_gmem.dtype)
    )
    n_idx = lax.axis_index("n")
    s_idx = lax.axis_index("s")

    def body(_, w_smem, x_smem, acc):
        # w_smem: [ROWS, bk] or [bk, ROWS]   x_smem: [T, bk]   acc: f32[64, T] (this warpgroup's)
        wg = lax.axis_index("wg")
        rows = pl.ds(wg * WG_ROWS, WG_ROWS)
        if w_smem.dtype == jnp.int8:  # weight-only int8: converted to the tokens' type
            a = w_smem[rows].astype(x_smem.dtype)
            if a_smem is not None:  # interpret mode's wgmma reads A from SMEM only
                a_smem[wg] = a
                plgpu.commit_smem()
                a = a_smem.at[wg]
        else:
            a = w_smem.at[rows] if out_in else plgpu.transpose_ref(w_smem.at[:, rows], (1, 0))
        plgpu.wgmma(acc, a, plgpu.transpose_ref(x_smem, (1, 0)))
        plgpu.wgmma_wait(0)
        return acc

    def compute_context(eval_pipeline):
        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((WG_ROWS, num_tokens), jnp.float32))
        def _(acc_ref):
            eval_pipeline(acc_ref)
            acc = acc_ref[...]
            wg = lax.axis_index("wg")
            rows = pl.ds(n_idx * ROWS + wg * WG_ROWS, WG_ROWS)
            epi = epilogue_tokens(num_tokens)
            # token columns through two SMEM slots: a slot is rewritten once its last store read it
            for i in range(num_tokens // epi):
                slot = i % 2
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                out_smem[wg, slot] = acc[:, i * epi : (i + 1) * epi]
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(
                    out_smem.at[wg, slot], partials_gmem.at[s_idx, rows, pl.ds(i * epi, epi)]
                )
            plgpu.wait_smem_to_gmem(0)

    pipeline = plgpu.emit_pipeline_warp_specialized(
        body,
        grid=(k_per_split // bk,),
        memory_registers=MEMORY_REGISTERS,
        in_specs=[w_spec, x_spec],
        wg_axis="wg",
        num_compute_wgs=COMPUTE_WGS,
        max_concurrent_steps=tn.stages,
        compute_context=compute_context,
    )
    rows = pl.ds(n_idx * ROWS, ROWS)
    cols = pl.ds(s_idx * k_per_split, k_per_split)
    pipeline(w_gmem.at[rows, cols] if out_in else w_gmem.at[cols, rows], x_gmem.at[:, cols])


def launch(
    x: jax.Array, w: jax.Array, *, w_layout: str, tn: SkinnyTuning, interpret: bool
) -> jax.Array:  # f32[splits, N, T]
    num_tokens, k = x.shape
    n = w.shape[0] if w_layout == "out_in" else w.shape[1]
    out_dtype = jnp.float32
    epi = epilogue_tokens(num_tokens)
    scratch = dict(
        out_smem=plgpu.SMEM(
            (COMPUTE_WGS, 2, WG_ROWS, epi), out_dtype, transforms=_transforms(epi * 4, out_dtype)
        )
    )
    if w.dtype == jnp.int8 and interpret:
        bk = tn.block_k
        scratch["a_smem"] = plgpu.SMEM(
            (COMPUTE_WGS, WG_ROWS, bk),
            x.dtype,
            transforms=_transforms(bk * x.dtype.itemsize, x.dtype),
        )
    kernel = plgpu.kernel(
        functools.partial(
            _kernel,
            tn=tn,
            w_layout=w_layout,
            num_tokens=num_tokens,
            k_per_split=k // tn.splits,
        ),
        out_type=jax.ShapeDtypeStruct((tn.splits, n, num_tokens), out_dtype),
        scratch_types=scratch,
        grid=(n // ROWS, tn.splits),
        grid_names=("n", "s"),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        # GPU interpret mode (CPU): runs the warpgroups as threads, barriers and TMA included
        interpret=plgpu.InterpretGPUParams() if interpret else False,
    )
    return kernel(w, x)
