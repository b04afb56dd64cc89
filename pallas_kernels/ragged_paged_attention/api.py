"""Public entry point: pick the implementation of ragged paged attention by backend name."""

from __future__ import annotations

import jax

from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention_reference

BACKENDS = ("reference",)


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
    backend: str = "reference",
) -> jax.Array:
    """Attention of a ragged step over paged KV; see `reference.py` for the contract."""
    if backend not in BACKENDS:
        raise ValueError(f"{backend=} must be one of {BACKENDS}")
    return ragged_paged_attention_reference(
        q, kv_pages, kv_lens, page_table, cu_q_lens, distribution, sm_scale=sm_scale, soft_cap=soft_cap
    )
