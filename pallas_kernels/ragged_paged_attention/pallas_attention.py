"""Jitted public API of the Pallas (Mosaic GPU) ragged paged attention: reference.py's contract.

On a GPU it compiles the Mosaic GPU kernel (Hopper: TMA + wgmma). On CPU it runs the same kernel in
Mosaic GPU interpret mode, which is how CI tests it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import device_info
from pallas_kernels.kv_layout import default_kv_scales, is_fp8, values_view
from pallas_kernels.ragged_paged_attention import schedule
from pallas_kernels.ragged_paged_attention.mgpu_kernel import Statics
from pallas_kernels.ragged_paged_attention.mgpu_launch import (
    launch,
    profile_smem_bytes,
)
from pallas_kernels.ragged_paged_attention.partial_merge import combine_splits, merge_prefill_parts
from pallas_kernels.ragged_paged_attention.tuning import (
    ROWS,
    SMEM_BYTES,
    SMEM_SLACK,
    TuningConfig,
    default_tuning,
)
from pallas_kernels.ragged_paged_attention.tuning_overrides import (
    TuningOverrides,
    fields_for,
    format_overrides,
    with_overrides,
)
from pallas_kernels.ragged_paged_attention.validate import check_inputs

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)
GPU_DTYPES = (jnp.bfloat16, jnp.float16)  # wgmma takes f32 only as tf32, and cannot transpose it
INTERPRET_DTYPES = (*GPU_DTYPES, jnp.float32)  # interpret mode: exact float32 products
INTERPRET_NUM_CTAS = 3  # CPU interpret mode: a few CTAs still exercise the persistent item loop
FP8_HEAD_DIMS = (32, 64, 128)  # an 8-bit page row of 16 bytes has no swizzled SMEM tiling
FP8_MIN_PAGE_SIZE = 32  # the same for V^T's rows (wgmma takes no unswizzled operand)


def check_pallas_inputs(q, kv_pages, page_table, *, sm_scale, soft_cap, interpret: bool) -> None:
    """What the kernel supports beyond the shared contract (raises ValueError)."""
    _, hq, d = q.shape
    _, hkv, _, page_size, _ = kv_pages.shape
    if d not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim={d} must be one of {SUPPORTED_HEAD_DIMS}")
    if hq // hkv > ROWS:
        raise ValueError(f"group={hq // hkv} (q heads per kv head) must be <= {ROWS}")
    if page_size < 8 or page_size & (page_size - 1):
        raise ValueError(f"{page_size=} must be a power of two >= 8")
    if is_fp8(kv_pages.dtype):
        if d not in FP8_HEAD_DIMS:
            raise ValueError(f"head_dim={d} must be one of {FP8_HEAD_DIMS} for fp8 pages")
        if page_size < FP8_MIN_PAGE_SIZE:
            raise ValueError(
                f"{page_size=} must be >= {FP8_MIN_PAGE_SIZE} for fp8 pages: a page's V^T "
                "(kv_layout.py) must fill whole 32-byte swizzled rows of P V's operand tile"
            )
    elif q.dtype != kv_pages.dtype:
        raise ValueError(f"{q.dtype=} must equal {kv_pages.dtype=} (or the pages be fp8)")
    dtypes = INTERPRET_DTYPES if interpret else GPU_DTYPES
    if not any(q.dtype == dt for dt in dtypes):
        raise ValueError(f"{q.dtype=} must be one of {dtypes} ({interpret=})")
    if not sm_scale > 0:
        raise ValueError(f"{sm_scale=} must be > 0")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"{soft_cap=} must be None or > 0")


def bucket_tuning(q, kv_pages, page_table, *, interpret: bool = False) -> TuningConfig:
    """The schedule a call with these shapes runs when it names none: default_tuning of its
    bucket on this machine's SMs (a few CTAs in interpret mode)."""
    num_tokens, hq, d = q.shape
    _, hkv, _, page_size, _ = kv_pages.shape
    num_seqs, pages_per_seq = page_table.shape
    return default_tuning(
        num_seqs=num_seqs,
        num_kv_heads=hkv,
        head_dim=d,
        page_size=page_size,
        pages_per_seq=pages_per_seq,
        dtype=q.dtype,
        num_tokens=num_tokens,
        num_q_heads=hq,
        num_ctas=INTERPRET_NUM_CTAS if interpret else device_info.num_sms(),
        kv_dtype=kv_pages.dtype,
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "soft_cap",
        "tuning",
        "tuning_overrides",
        "interpret",
        "a_operands",
        "profile_dir",
    ),
)
def ragged_paged_attention_pallas(
    q: jax.Array,  # [T, Hq, D]
    kv_pages: jax.Array,  # [P, Hkv, 2, PS, D]
    kv_lens: jax.Array,  # int32[S]
    page_table: jax.Array,  # int32[S, MP]
    cu_q_lens: jax.Array,  # int32[S + 1]
    distribution: jax.Array,  # int32[2]  (num_decode_seqs, num_seqs)
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    kv_scales: jax.Array | None = None,  # f32[2] (k_scale, v_scale) of fp8 pages; None: default
    tuning: TuningConfig | None = None,
    tuning_overrides: TuningOverrides = (),
    interpret: bool | None = None,
    a_operands: str = "regs",
    profile_dir: str | None = None,
) -> jax.Array:
    """Ragged paged attention of one step (decode rows first, then prefill chunks); see
    reference.py.

    Constraints beyond reference.py: head_dim 16, 32, 64 or 128, at most 64 q heads per kv head,
    page_size a power of two >= 8, q and kv_pages of one dtype: bf16 or f16 on GPU, also float32 in
    interpret mode; cu_q_lens[0] == 0. Page ids are not checked on device: the host validates them.
    fp8 pages (float8_e4m3fn or float8_e5m2, kv_layout.py, V stored transposed) with q of any
    of those dtypes, head_dim 32, 64 or 128 and page_size >= 32: P V in fp8 (P rounded to e4m3),
    Q K^T in fp8 or on K dequantized to float16 (tuning.fp8_qk; mgpu_consumer.py).

    tuning_overrides (tuning_overrides.py): fields set over `tuning`, or over the bucket's
    default schedule where `tuning` is None, by the clauses that select this bucket's token
    count (EngineConfig.attention_tuning).

    profile_dir (GPU only): write a Mosaic GPU profiler trace of each call there (per compute
    warpgroup: spans wait_k, qk, softmax, wait_v, pv of every KV block, up to 1,024 per call;
    benchmarks/kernels/attention_profile.py summarises them). It costs SMEM, so the tuning must
    leave room for it.
    """
    check_inputs(q, kv_pages, kv_lens, page_table, cu_q_lens, distribution, kv_scales)
    if interpret is None:
        interpret = device_info.on_cpu()
    check_pallas_inputs(
        q, kv_pages, page_table, sm_scale=sm_scale, soft_cap=soft_cap, interpret=interpret
    )
    num_tokens, hq, d = q.shape
    _, hkv, _, page_size, _ = kv_pages.shape
    num_seqs, pages_per_seq = page_table.shape
    kv_fp8 = is_fp8(kv_pages.dtype)
    # wgmma's operand dtype: fp8 pages dequantize to float16 (float32 for float32 q, interpret).
    mma_dtype = q.dtype if not kv_fp8 or q.dtype == jnp.float32 else jnp.dtype(jnp.float16)
    if kv_fp8 and kv_scales is None:
        kv_scales = default_kv_scales()
    if tuning is None:
        tuning = bucket_tuning(q, kv_pages, page_table, interpret=interpret)
    if a_operands not in ("regs", "smem"):
        raise ValueError(f"{a_operands=} must be 'regs' or 'smem'")
    a_in_smem = a_operands == "smem"
    fits = dict(on_chip=not interpret, a_in_smem=a_in_smem, kv_dtype=kv_pages.dtype)
    if not fields_for(tuning_overrides, num_tokens):
        tuning.check_fits(d, page_size, q.dtype, **fits)
    else:  # the same check, its error naming the override and the bucket
        try:
            tuning = with_overrides(tuning, tuning_overrides, num_tokens)
            tuning.check_fits(d, page_size, q.dtype, **fits)
        except ValueError as e:
            raise ValueError(
                f"attention_tuning {format_overrides(tuning_overrides)!r} does not fit the "
                f"bucket of {num_tokens} tokens x {num_seqs} sequences x {pages_per_seq} pages "
                f"of {page_size} (q {hq} heads, kv {hkv} heads of {d}, {kv_pages.dtype} pages): "
                f"{e}"
            ) from None
    if profile_dir is not None:
        if interpret:
            raise ValueError(f"{profile_dir=}: the profiler runs on a GPU, not in interpret mode")
        need = tuning.smem_bytes(d, q.dtype, a_in_smem=a_in_smem, kv_dtype=kv_pages.dtype)
        need += profile_smem_bytes(tuning)
        if need > SMEM_BYTES - SMEM_SLACK:
            raise ValueError(f"{tuning} with the profiler needs {need} bytes of SMEM for {d=}")
    # Whole blocks of page ids per sequence: pad the table's rows with the null page.
    ppb = max(1, tuning.block_kv // page_size)
    pad = -pages_per_seq % ppb
    if pad:
        page_table = jnp.pad(page_table, ((0, 0), (0, pad)))
    # Q as [T, Hkv, G, D], a free reshape: the kernel copies each token's [G, D] slab of a kv
    # head straight into a warpgroup's rows, and stores O the same way (no head-major transposes
    # around the call). A prefill Q box spans tokens_per_wg tokens and must fit inside [0, T):
    # pad tiny buckets.
    g = hq // hkv
    tpw = ROWS // g
    t_pad = max(num_tokens, tpw)
    q4 = jnp.pad(q, ((0, t_pad - num_tokens), (0, 0), (0, 0))) if t_pad > num_tokens else q
    q4 = q4.reshape(t_pad, hkv, g, d)
    st = Statics(
        num_tokens=t_pad,
        num_kv_heads=hkv,
        group=g,
        head_dim=d,
        page_size=page_size,
        pages_per_seq=pages_per_seq + pad,
        sm_scale=float(sm_scale),
        soft_cap=None if soft_cap is None else float(soft_cap),
        tuning=tuning,
        a_operands="smem" if interpret else a_operands,
        mma_dtype=jnp.dtype(mma_dtype),
        kv_fp8=kv_fp8,
    )
    # Padding tokens become one more prefill sequence with no KV, whose rows the kernel zeroes.
    kv_lens, cu_q_lens, distribution = schedule.with_padding_sequence(
        kv_lens, cu_q_lens, distribution, num_tokens=num_tokens
    )
    plan_args = dict(num_tokens=num_tokens, block_kv=tuning.block_kv, num_kv_heads=hkv,
                     num_ctas=tuning.num_ctas)  # fmt: skip
    if tuning.prefill_per_step:  # interleaved one-box tiles or paired ones, as this step pays
        plan = schedule.per_step_parts(
            cu_q_lens, kv_lens, distribution, tokens_per_wg=tpw,
            decode_splits=tuning.decode_splits, **plan_args,
        )  # fmt: skip
    else:
        plan = schedule.prefill_parts(
            cu_q_lens, kv_lens, distribution, tokens_per_tile=st.tokens_per_tile,
            max_splits=tuning.prefill_kv_splits, **plan_args,
        )  # fmt: skip
    interp = plgpu.InterpretGPUParams() if interpret else False
    out, opart, lse, part_lse = launch(
        st,
        plan.meta,
        kv_lens,
        cu_q_lens,
        page_table,
        plan.parts,
        q4,
        kv_pages,
        values_view(kv_pages) if kv_fp8 else None,
        kv_scales if kv_fp8 else None,
        interpret=interp,
        profile_dir=profile_dir,
    )
    out = merge_prefill_parts(
        out,
        part_lse,
        plan.tile_tok,
        plan.tile_parts,
        cu_q_lens,
        distribution,
        group=g,
        tokens_per_wg=tpw,
        boxes_per_tile=tuning.prefill_boxes,
    )
    out = out.reshape(t_pad, hq, d)[:num_tokens]
    if tuning.decode_splits > 1:
        out = combine_splits(
            out,
            opart,
            lse,
            cu_q_lens,
            distribution[0],
            num_kv_heads=hkv,
            splits=tuning.decode_splits,
        )
    return out
