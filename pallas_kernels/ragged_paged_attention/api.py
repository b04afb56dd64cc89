"""Public entry points: the engine's attention step (KV write + attention) and attention alone.

`backend` picks the implementation; every backend computes the function `reference.py` defines.

    "reference"  pure jnp (XLA), any device. With fp8 pages it reads Q rows in e4m3, as the
                 kernel's default schedule does (tuning.reads_fp8_query), and P in e4m3, as the
                 kernel always does (reference.quantize_probs).
    "pallas"     the Mosaic GPU kernel (pallas_attention.py): compiled on a GPU (Hopper), run in
                 Mosaic GPU interpret mode on CPU. float32 on a GPU takes the reference path: wgmma
                 multiplies float32 only as tf32 and cannot transpose it (docs/kernels.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.kv_layout import is_fp8, write_kv_step
from pallas_kernels.ragged_paged_attention.pallas_attention import ragged_paged_attention_pallas
from pallas_kernels.ragged_paged_attention.reference import (
    QUERY_DTYPE,
    quantize_query_rows,
    ragged_paged_attention_reference,
)
from pallas_kernels.ragged_paged_attention.tuning import reads_fp8_query
from pallas_kernels.ragged_paged_attention.tuning_overrides import TuningOverrides

BACKENDS = ("reference", "pallas")


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"{backend=} must be one of {BACKENDS}")


def kernel_runs(dtype, platform: str) -> bool:
    """Whether the "pallas" backend runs the kernel for a model of `dtype` on `platform` ("gpu",
    "cpu"): float32 on a GPU takes the reference path (module docstring)."""
    return not (platform == "gpu" and jnp.dtype(dtype) == jnp.float32)


def ragged_paged_attention(
    q: jax.Array,
    kv_pages: jax.Array,
    kv_lens: jax.Array,
    page_table: jax.Array,
    cu_q_lens: jax.Array,
    distribution: jax.Array,
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    kv_scales: jax.Array | None = None,
    backend: str = "reference",
    tuning_overrides: TuningOverrides = (),
) -> jax.Array:
    """Attention of a ragged step over paged KV that already holds the step's K/V.

    kv_pages of an fp8 dtype (kv_layout.kv_page_dtype) hold quantized K/V: kv_scales, f32[2]
    (k_scale, v_scale), or None for the default scales. tuning_overrides: fields of the kernel's
    schedule set over each bucket's default (tuning_overrides.py; the pallas backend only)."""
    _check_backend(backend)
    args = (q, kv_pages, kv_lens, page_table, cu_q_lens, distribution)
    kw = dict(sm_scale=sm_scale, soft_cap=soft_cap, kv_scales=kv_scales)
    if backend == "pallas" and kernel_runs(q.dtype, jax.default_backend()):
        return ragged_paged_attention_pallas(*args, **kw, tuning_overrides=tuning_overrides)
    if reads_fp8_query(kv_pages.dtype):  # as the kernel's default schedule does
        args = (quantize_query_rows(q, QUERY_DTYPE), *args[1:])
    return ragged_paged_attention_reference(*args, **kw, fp8_probs=is_fp8(kv_pages.dtype))


def attention_step(
    q: jax.Array,  # [T, Hq, D]
    k: jax.Array,  # [T, Hkv, D]  this step's new keys (RoPE applied)
    v: jax.Array,  # [T, Hkv, D]
    kv_pages: jax.Array,  # [P, Hkv, 2, PS, D]
    slot_mapping: jax.Array,  # int32[T]
    kv_lens: jax.Array,  # int32[S]
    page_table: jax.Array,  # int32[S, MP]
    cu_q_lens: jax.Array,  # int32[S + 1]
    distribution: jax.Array,  # int32[2]
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    kv_scales: jax.Array | None = None,  # f32[2] for fp8 pages (None: the default scales)
    backend: str = "reference",
    tuning_overrides: TuningOverrides = (),  # the kernel's schedule fields (pallas only)
) -> tuple[jax.Array, jax.Array]:
    """What one model layer calls: write the step's K/V into the pages, then attend.

    Returns (out [T, Hq, D], updated kv_pages). Every backend writes with `write_kv_step` (an XLA
    scatter of 32-bit words, its slots promised distinct, in place when kv_pages is donated; it
    quantizes for fp8 pages) before attending; see docs/kernels.md.
    """
    _check_backend(backend)
    kv_pages = write_kv_step(kv_pages, k, v, slot_mapping, kv_scales)
    out = ragged_paged_attention(
        q,
        kv_pages,
        kv_lens,
        page_table,
        cu_q_lens,
        distribution,
        sm_scale=sm_scale,
        soft_cap=soft_cap,
        kv_scales=kv_scales,
        backend=backend,
        tuning_overrides=tuning_overrides,
    )
    return out, kv_pages
