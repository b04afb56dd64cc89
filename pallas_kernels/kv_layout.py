"""The one definition of a KV page array's layout, and the write of a step's new K/V into it.

One array per layer:

    kv_pages: [num_pages, num_kv_heads, 2, page_size, head_dim]     (axis 2: 0 = K, 1 = V)

Why this order: the tile a kernel streams for one (page, kv head) is `kv_pages[page, head]`, a
contiguous [2, page_size, head_dim] block holding both K and V. One bulk copy (TMA on Hopper)
fetches it, every GMEM stride but the last is a multiple of 16 bytes for head_dim >= 8, and tensor
parallelism shards axis 1 (kv heads) without touching the page axis.

Page 0 is the null page: padded tokens write into it and padded page-table entries point at it.
It is never handed to a request, so its contents are garbage by design and never read unmasked.

A token's slot is `page * page_size + offset`; `slot_mapping[T]` carries one slot per step token.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

NULL_PAGE = 0
K_INDEX = 0
V_INDEX = 1


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """Shape of one layer's page array; `shape` is what the engine allocates and shards."""

    num_pages: int
    num_kv_heads: int
    page_size: int
    head_dim: int

    def __post_init__(self) -> None:
        for name in ("num_pages", "num_kv_heads", "page_size", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.num_pages < 2:
            raise ValueError(f"num_pages={self.num_pages} must be >= 2 (page 0 is the null page)")

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_pages, self.num_kv_heads, 2, self.page_size, self.head_dim)

    # Axis of `shape` that tensor parallelism shards (kv heads).
    KV_HEAD_AXIS = 1


def _check_write_inputs(kv_pages: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array):
    if kv_pages.ndim != 5 or kv_pages.shape[2] != 2:
        raise ValueError(
            f"{kv_pages.shape=} must be [num_pages, num_kv_heads, 2, page_size, head_dim]"
        )
    _, hkv, _, _, d = kv_pages.shape
    if k.shape != v.shape or k.ndim != 3 or k.shape[1:] != (hkv, d):
        raise ValueError(f"{k.shape=} and {v.shape=} must both be [T, {hkv}, {d}]")
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"{slot_mapping.shape=} must be ({k.shape[0]},)")


def write_kv_reference(
    kv_pages: jax.Array,  # [P, Hkv, 2, PS, D]
    k: jax.Array,  # [T, Hkv, D]
    v: jax.Array,  # [T, Hkv, D]
    slot_mapping: jax.Array,  # int32[T]
) -> jax.Array:
    """Scatter the step's K/V into their slots. Padding tokens target page 0 and may collide."""
    _check_write_inputs(kv_pages, k, v, slot_mapping)
    page_size = kv_pages.shape[3]
    pages = slot_mapping // page_size
    offsets = slot_mapping % page_size
    kv = jnp.stack([k, v], axis=2).astype(kv_pages.dtype)  # [T, Hkv, 2, D]
    # Advanced indices on axes 0 and 3 are separated by slices, so the indexed dims go first: the
    # update has shape [T, Hkv, 2, D], exactly `kv`.
    return kv_pages.at[pages, :, :, offsets, :].set(kv, mode="promise_in_bounds")


def _as_words(x: jax.Array, per_word: int) -> jax.Array:
    """[..., D] of a narrow dtype as u32[..., D / per_word]: a bitcast, no data moves."""
    return lax.bitcast_convert_type(x.reshape(*x.shape[:-1], -1, per_word), jnp.uint32)


def write_kv_packed(
    kv_pages: jax.Array,  # [P, Hkv, 2, PS, D]
    k: jax.Array,  # [T, Hkv, D]
    v: jax.Array,  # [T, Hkv, D]
    slot_mapping: jax.Array,  # int32[T]
) -> jax.Array:
    """write_kv_reference's pages, with the scatter moving 32-bit words instead of 16-bit (or
    8-bit) values: the pages and the update bitcast to u32 (head_dim / 2 words per row for bf16)
    and back, free reshapes on both sides.

    Why: XLA's GPU scatter of bf16 elements wrote at about 250 GB/s on the H200, 131 us per layer
    for an 8,192-token chunk (32q/8kv/128), and the same scatter of u32 words takes 19.5 us
    (docs/benchmarks.md, "The KV write"). The page layout, and with it the kv-head sharding of
    axis 1, is unchanged. 32-bit pages, and rows that are not a whole number of words, take the
    reference scatter.
    """
    _check_write_inputs(kv_pages, k, v, slot_mapping)
    itemsize = jnp.dtype(kv_pages.dtype).itemsize
    per_word = 4 // itemsize if itemsize < 4 else 1
    if per_word == 1 or kv_pages.shape[-1] % per_word:
        return write_kv_reference(kv_pages, k, v, slot_mapping)
    k, v = k.astype(kv_pages.dtype), v.astype(kv_pages.dtype)
    words = write_kv_reference(
        _as_words(kv_pages, per_word), _as_words(k, per_word), _as_words(v, per_word), slot_mapping
    )
    out = lax.bitcast_convert_type(words, kv_pages.dtype)  # [..., D / per_word, per_word]
    return out.reshape(kv_pages.shape)


@functools.partial(jax.jit, donate_argnums=(0,))
def write_kv(kv_pages: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array) -> jax.Array:
    """Jitted, donating KV write (in place); inside the engine's step the body is inlined."""
    return write_kv_packed(kv_pages, k, v, slot_mapping)
