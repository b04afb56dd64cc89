"""Pallas kernels of Nori-JAX, each with a pure-jnp reference beside it.

The KV page layout every kernel, the reference path, the KV write and the sharding spec share is
defined once, in `kv_layout`.
"""

from pallas_kernels.kv_layout import KVLayout, write_kv, write_kv_packed, write_kv_reference
from pallas_kernels.ragged_paged_attention import (
    attention_step,
    ragged_paged_attention,
    ragged_paged_attention_reference,
)

__all__ = [
    "KVLayout",
    "attention_step",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
    "write_kv",
    "write_kv_reference",
    "write_kv_packed",
]
