"""Static input checks shared by every ragged paged attention implementation."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.kv_layout import check_kv_scales


def check_inputs(
    q: jax.Array,
    kv_pages: jax.Array,
    kv_lens: jax.Array,
    page_table: jax.Array,
    cu_q_lens: jax.Array,
    distribution: jax.Array,
    kv_scales: jax.Array | None = None,
) -> None:
    """Raise ValueError naming the bad value; shapes and dtypes only (values are on device)."""
    if q.ndim != 3:
        raise ValueError(f"{q.shape=} must be [T, num_q_heads, head_dim]")
    if kv_pages.ndim != 5 or kv_pages.shape[2] != 2:
        raise ValueError(
            f"{kv_pages.shape=} must be [num_pages, num_kv_heads, 2, page_size, head_dim]"
        )
    _, hq, d = q.shape
    _, hkv, _, _, d_kv = kv_pages.shape
    if d != d_kv:
        raise ValueError(f"q head_dim {d} != kv_pages head_dim {d_kv}")
    if hq % hkv:
        raise ValueError(f"num_q_heads={hq} must be a multiple of num_kv_heads={hkv}")
    if kv_lens.ndim != 1:
        raise ValueError(f"{kv_lens.shape=} must be [S]")
    s = kv_lens.shape[0]
    if page_table.ndim != 2 or page_table.shape[0] != s:
        raise ValueError(f"{page_table.shape=} must be [{s}, max_pages_per_seq]")
    if cu_q_lens.shape != (s + 1,):
        raise ValueError(f"{cu_q_lens.shape=} must be ({s + 1},)")
    if distribution.shape != (2,):
        raise ValueError(f"{distribution.shape=} must be (2,): (num_decode_seqs, num_seqs)")
    for name, x in (
        ("kv_lens", kv_lens),
        ("page_table", page_table),
        ("cu_q_lens", cu_q_lens),
        ("distribution", distribution),
    ):
        if x.dtype != jnp.int32:
            raise ValueError(f"{name}.dtype={x.dtype} must be int32")
    check_kv_scales(kv_pages, kv_scales)
