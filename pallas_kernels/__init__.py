"""Pallas kernels of Nori-JAX, each with a pure-jnp reference beside it.

The KV page layout every kernel, the reference path, the KV write and the sharding spec share is
defined once, in `kv_layout` (its JAX-free constants in `page_constants`, which host code such as
the page allocator imports). The public names load lazily, so importing `page_constants` does not
pull in JAX.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "KVLayout": "pallas_kernels.kv_layout",
    "write_kv": "pallas_kernels.kv_layout",
    "write_kv_packed": "pallas_kernels.kv_layout",
    "write_kv_reference": "pallas_kernels.kv_layout",
    "attention_step": "pallas_kernels.ragged_paged_attention",
    "attention_step_sharded": "pallas_kernels.ragged_paged_attention",
    "ragged_paged_attention": "pallas_kernels.ragged_paged_attention",
    "ragged_paged_attention_reference": "pallas_kernels.ragged_paged_attention",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from pallas_kernels.kv_layout import (  # noqa: F401
        KVLayout,
        write_kv,
        write_kv_packed,
        write_kv_reference,
    )
    from pallas_kernels.ragged_paged_attention import (  # noqa: F401
        attention_step,
        attention_step_sharded,
        ragged_paged_attention,
        ragged_paged_attention_reference,
    )


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'pallas_kernels' has no attribute {name!r}")
