"""Float weights to a scheme's stored values with qwix (absmax calibration), and values that a
checkpoint already holds quantized (GGUF blocks) in the same form.

qwix's symmetric rule: scale = absmax / bound, with bound = 448 for fp8 e4m3, 127.5 for int8 and
7.5 for int4 (the integer bounds are half a step past qmax, so the top bucket is a full one; a
value at the absmax itself rounds to qmax + 1 and is clipped to qmax, an error of half a step like
every other value). All-zero channels get scale 1.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import qwix

from nori_jax.quantization.scheme import WeightQuantization


@dataclasses.dataclass(frozen=True)
class QuantizedTensor:
    """A linear weight a checkpoint stores quantized, in the scheme's layout (scheme.py):
    `qvalue[out, in]` in the scheme's qtype, `scale` and `offset` `[out, groups]` float32."""

    qvalue: np.ndarray
    scale: np.ndarray
    offset: np.ndarray | None = None

    def leaves(self) -> dict[str, np.ndarray]:
        out = {"qvalue": self.qvalue, "scale": self.scale}
        if self.offset is not None:
            out["offset"] = self.offset
        return out


def quantize_array(w: jax.Array, scheme: WeightQuantization, scale_dtype) -> dict[str, jax.Array]:
    """w[out, in] (float) -> {"qvalue", "scale"}: per output channel, or per group of inputs."""
    if scheme.offset:
        raise ValueError(
            f"{scheme.describe()} holds a checkpoint's own offsets; float weights are quantized "
            "symmetrically (use the mode's default layout)"
        )
    tiled = {} if scheme.group_size is None else {1: scheme.group_size}
    q = qwix.quantize(w.astype(jnp.float32), scheme.qtype, channelwise_axes=(0,), tiled_axes=tiled)
    return {"qvalue": q.qvalue, "scale": q.scale.astype(scale_dtype)}


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def quantize_on_device(
    w: jax.Array, scheme: WeightQuantization, scale_dtype, shardings: tuple
) -> dict[str, jax.Array]:
    """`quantize_array` with each result born on its sharding ((qvalue's, scale's))."""
    leaves = quantize_array(w, scheme, scale_dtype)
    return {
        k: jax.lax.with_sharding_constraint(v, s)
        for (k, v), s in zip(leaves.items(), shardings, strict=True)
    }


def dequantize_leaves(leaves: dict[str, jax.Array], scheme: WeightQuantization) -> jax.Array:
    """The float32 weight [out, in] the stored values stand for (a reference for tests)."""
    q, scale = jnp.asarray(leaves["qvalue"]), jnp.asarray(leaves["scale"], jnp.float32)
    out, groups = scale.shape
    w = q.astype(jnp.float32).reshape(out, groups, -1) * scale[:, :, None]
    if leaves.get("offset") is not None:
        w = w + jnp.asarray(leaves["offset"], jnp.float32)[:, :, None]
    return w.reshape(q.shape)


def stored_bytes(state_leaves) -> int:
    """Bytes of the arrays at their nominal width (int4: half a byte per value)."""
    total = 0
    for x in state_leaves:
        dt = jnp.dtype(x.dtype)
        bits = jnp.iinfo(dt).bits if jnp.issubdtype(dt, jnp.integer) else jnp.finfo(dt).bits
        total += x.size * bits // 8
    return total
