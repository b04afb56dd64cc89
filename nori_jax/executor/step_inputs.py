"""The device side of the packed step buffer: static slices of it (core/step_layout.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from nori_jax.core.step_layout import TOKEN_FIELDS, StepLayout


def unpack_tokens(layout: StepLayout, step: jax.Array, bucket: int) -> dict[str, jax.Array]:
    """int32[layout.size] -> {input_ids, positions, slot_mapping, prev_index}, each int32[T]."""
    c = layout.token_capacity
    return {name: step[i * c : i * c + bucket] for i, name in enumerate(TOKEN_FIELDS)}


def unpack_rows(layout: StepLayout, step: jax.Array) -> dict[str, jax.Array]:
    """int32[layout.size] -> every per-row field in its shape and dtype (floats bitcast back)."""
    out = {}
    for f in layout.row_fields:
        x = step[f.offset : f.offset + f.size].reshape(f.shape)
        if f.dtype is np.float32:
            x = jax.lax.bitcast_convert_type(x, jnp.float32)
        out[f.name] = x
    return out
