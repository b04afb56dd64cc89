"""The pure-jnp definition of `skinny_matmul` (same signature, no tuning)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def skinny_matmul_reference(
    x: jax.Array,  # [T, K]
    w: jax.Array,  # [N, K] (w_layout "out_in") or [K, N] ("in_out")
    group_scales: jax.Array | None = None,  # [N, K / group]
    *,
    w_layout: str,
    interpret: bool | None = None,
    tuning=None,
) -> jax.Array:  # float32 [T, N]
    """x @ w^T (out_in) or x @ w (in_out), products exact in float32, summed in float32; with
    `group_scales`, each group of inputs' weights scaled by its group's scale first."""
    del interpret, tuning
    w32 = w.astype(jnp.float32)
    if w_layout == "out_in":
        w32 = w32.T  # [K, N]
    if group_scales is not None:
        group = w32.shape[0] // group_scales.shape[1]
        w32 = w32 * jnp.repeat(group_scales.astype(jnp.float32).T, group, axis=0)
    return jnp.dot(x.astype(jnp.float32), w32, precision=jax.lax.Precision.HIGHEST)
