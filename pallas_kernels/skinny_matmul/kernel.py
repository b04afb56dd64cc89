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
TMA_MIN_BYTES = 16  # TMA's narrowest box row, and the unit of its GMEM strides
COMPUTE_WGS = ROWS // WG_ROWS
MEMORY_REGISTERS = 40  # the TMA-issuing warpgroup needs few; the compute warpgroups get the rest


def scale_block(dtype) -> int:
    """Groups of scales per TMA box: the narrowest box TMA copies."""
    return TMA_MIN_BYTES // jnp.dtype(dtype).itemsize


def _transforms(row_bytes: int, dtype) -> tuple:
    """wgmma's operand layout in SMEM: (8, swizzle in elements) tiles, swizzled."""
    swizzle = next(s for s in (128, 64, 32) if row_bytes % s == 0)
    elems = swizzle * 8 // jax.dtypes.itemsize_bits(dtype)
    return (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(swizzle))


def _kernel(
    w_gmem,
    x_gmem,
    *gmem_refs,
    out_smem,
    a_smem=None,
    tn,
    w_layout,
    num_tokens,
    k_per_split,
    grouped,
):
    # w_gmem: [N, K] (out_in) or [K, N] (in_out)     x_gmem: [T, K]
    # gmem_refs: (scales_gmem,) if grouped, then partials_gmem
    #   scales_gmem: [N, groups], a scale per group of block_k inputs; groups a multiple of
    #     scale_block(dtype) (the caller pads)
    #   partials_gmem: f32[splits, N, T]
    # out_smem: f32[COMPUTE_WGS, 2 slots, 64, epilogue_tokens(T)]
    # a_smem: x.dtype[COMPUTE_WGS, 64, bk] for integer weights in interpret mode, else None
    scales_gmem, partials_gmem = gmem_refs if grouped else (None, *gmem_refs)
    out_in = w_layout == "out_in"
    bk = tn.block_k
    w_bits = jax.dtypes.itemsize_bits(w_gmem.dtype)
    x_bits = jax.dtypes.itemsize_bits(x_gmem.dtype)
    if out_in:  # [ROWS, bk] blocks, K contiguous
        w_spec = plgpu.BlockSpec(
            (ROWS, bk), lambda k: (0, k), transforms=_transforms(bk * w_bits // 8, w_gmem.dtype)
        )
    else:  # [bk, ROWS] blocks, the rows contiguous
        w_spec = plgpu.BlockSpec(
            (bk, ROWS), lambda k: (k, 0), transforms=_transforms(ROWS * w_bits // 8, w_gmem.dtype)
        )
    x_spec = plgpu.BlockSpec(
        (num_tokens, bk), lambda k: (0, k), transforms=_transforms(bk * x_bits // 8, x_gmem.dtype)
    )
    # The scales of a step's group: TMA copies no box narrower than 16 bytes, so a step fetches
    # the [ROWS, sb] block of groups holding its own (sb = 16 bytes of scales) and picks its
    # column in registers. The index is absolute: a block may straddle two splits.
    sb = scale_block(scales_gmem.dtype) if grouped else 1
    groups_per_split = k_per_split // bk

    def group_index(k):
        return lax.axis_index("s") * groups_per_split + k

    s_spec = plgpu.BlockSpec((ROWS, sb), lambda k: (0, group_index(k) // sb))
    n_idx = lax.axis_index("n")
    s_idx = lax.axis_index("s")

    def operand_a(w_smem, rows, dtype):
        """This warpgroup's weight rows as wgmma's A operand: integers converted in registers
        to the tokens' type (in interpret mode, whose wgmma reads A from SMEM only, through
        a_smem)."""
        wg = lax.axis_index("wg")
        if jnp.issubdtype(w_smem.dtype, jnp.integer):
            a = w_smem[rows].astype(dtype)
            if a_smem is not None:
                a_smem[wg] = a
                plgpu.commit_smem()
                a = a_smem.at[wg]
            return a
        return w_smem.at[rows] if out_in else w_smem.at[:, rows].T

    def body(_, w_smem, x_smem, acc):
        # w_smem: [ROWS, bk] or [bk, ROWS]   x_smem: [T, bk]   acc: f32[64, T] (this warpgroup's)
        rows = pl.ds(lax.axis_index("wg") * WG_ROWS, WG_ROWS)
        plgpu.wgmma(acc, operand_a(w_smem, rows, x_smem.dtype), x_smem.T)
        plgpu.wgmma_wait(0)
        return acc

    def grouped_body(idx, w_smem, x_smem, s_smem, acc):
        # One group of block_k inputs per step: its product in a fresh accumulator, scaled per
        # weight row (the group's scale), added to the running sum (a value carried in registers).
        rows = pl.ds(lax.axis_index("wg") * WG_ROWS, WG_ROWS)
        a = operand_a(w_smem, rows, x_smem.dtype)

        def product(part_ref):
            plgpu.wgmma(part_ref, a, x_smem.T)
            return part_ref[...]

        part = pl.run_scoped(product, plgpu.ACC((WG_ROWS, num_tokens), jnp.float32))
        (k,) = idx
        block = s_smem[rows, :].astype(jnp.float32)  # [64, sb]
        # (a column read of SMEM is refused by the lowering: "non-contiguous" for its swizzle)
        pick = lax.broadcasted_iota(jnp.int32, block.shape, 1) == group_index(k) % sb
        scale = jnp.sum(jnp.where(pick, block, 0.0), axis=1)
        return acc + part * lax.broadcast_in_dim(scale, (WG_ROWS, num_tokens), (0,))

    def compute_context(eval_pipeline):
        if grouped:
            epilogue(eval_pipeline(jnp.zeros((WG_ROWS, num_tokens), jnp.float32)))
            return

        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((WG_ROWS, num_tokens), jnp.float32))
        def _(acc_ref):
            eval_pipeline(acc_ref)
            epilogue(acc_ref[...])

    def epilogue(acc):
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
        grouped_body if grouped else body,
        grid=(k_per_split // bk,),
        memory_registers=MEMORY_REGISTERS,
        in_specs=[w_spec, x_spec, s_spec] if grouped else [w_spec, x_spec],
        wg_axis="wg",
        num_compute_wgs=COMPUTE_WGS,
        max_concurrent_steps=tn.stages,
        compute_context=compute_context,
    )
    rows = pl.ds(n_idx * ROWS, ROWS)
    cols = pl.ds(s_idx * k_per_split, k_per_split)
    operands = [w_gmem.at[rows, cols] if out_in else w_gmem.at[cols, rows], x_gmem.at[:, cols]]
    if grouped:
        operands.append(scales_gmem.at[rows, :])
    pipeline(*operands)


def launch(
    x: jax.Array,
    w: jax.Array,
    group_scales: jax.Array | None,
    *,
    w_layout: str,
    tn: SkinnyTuning,
    interpret: bool,
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
    a_in_smem = interpret and jnp.issubdtype(w.dtype, jnp.integer)
    if a_in_smem:
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
            grouped=group_scales is not None,
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
    return kernel(w, x) if group_scales is None else kernel(w, x, group_scales)
