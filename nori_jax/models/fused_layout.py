"""Fused projections: q/k/v as one matmul, gate/up as another, and the one place that knows
their layout.

One matmul of x against [q | k | v] instead of three (and [gate | up] instead of two) reads x once,
launches fewer kernels and gives the forward pass fewer arguments to launch with (each costs the
host 0.75-1.6 us on the H200, docs/benchmarks.md, "Host costs"). The fused weights are laid out so
that Megatron's column split over the mesh axis `model` (contiguous equal chunks of the output
features) hands every device exactly its own heads and MLP columns, for any tensor-parallel size
the model allows, so one stored layout serves every mesh (and the parameter cache):

- qkv, by kv head: [q heads of kv head 0 | k head 0 | v head 0 | q heads of kv head 1 | ...],
  (group + 2) x head_dim output features per kv head. A device with whole kv heads holds whole
  groups. (Where a device holds part of a kv head, k/v are replicated instead and not fused.)
- gate/up, by column: [gate 0, up 0, gate 1, up 1, ...]; any split of the MLP's width keeps pairs.

Checkpoints store the projections apart; `fuse_*` builds the fused rows on the host from arrays in
the checkpoint's [out, ...] layout (weights [out, in], biases [out], a quantized weight's qvalue
and scales [out, ...]), `unfuse_*` takes them apart again (weights/export.py), and `split_*`
takes the matmul's output apart on the device.
"""

from __future__ import annotations

import jax
import numpy as np


def fuse_qkv(q: np.ndarray, k: np.ndarray, v: np.ndarray, num_kv_heads: int) -> np.ndarray:
    """[Hq*D, ...], [Hkv*D, ...] x 2 -> [Hkv*(G+2)*D, ...] (G = Hq / Hkv), grouped by kv head."""
    rest = q.shape[1:]
    parts = [x.reshape(num_kv_heads, -1, *rest) for x in (q, k, v)]
    return np.concatenate(parts, axis=1).reshape(-1, *rest)  # [Hkv, (G + 2) * D, ...] flat


def fuse_gate_up(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """[F, ...] x 2 -> [2F, ...], gate and up alternating by row."""
    return np.stack([gate, up], axis=1).reshape(-1, *gate.shape[1:])


def unfuse_qkv(
    fused: np.ndarray, num_heads: int, num_kv_heads: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`fuse_qkv`'s inverse: [Hkv*(G+2)*D, ...] -> q [Hq*D, ...], k and v [Hkv*D, ...]."""
    rest = fused.shape[1:]
    g = num_heads // num_kv_heads
    y = fused.reshape(num_kv_heads, g + 2, -1, *rest)  # [Hkv, G + 2, D, ...]
    q, k, v = y[:, :g], y[:, g], y[:, g + 1]
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def unfuse_gate_up(fused: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`fuse_gate_up`'s inverse: [2F, ...] -> gate [F, ...], up [F, ...]."""
    y = fused.reshape(-1, 2, *fused.shape[1:])
    return y[:, 0], y[:, 1]


def split_qkv(y: jax.Array, num_heads: int, num_kv_heads: int, head_dim: int):
    """The fused matmul's output [T, Hkv*(G+2)*D] -> q [T, Hq, D], k and v [T, Hkv, D]."""
    t, g = y.shape[0], num_heads // num_kv_heads
    y = y.reshape(t, num_kv_heads, g + 2, head_dim)
    q = y[:, :, :g].reshape(t, num_heads, head_dim)
    return q, y[:, :, g], y[:, :, g + 1]


def split_gate_up(y: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[T, 2F] -> gate [T, F], up [T, F]."""
    y = y.reshape(y.shape[0], -1, 2)
    return y[..., 0], y[..., 1]
