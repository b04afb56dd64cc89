"""The one definition of a KV page array's layout, and the write of a step's new K/V into it.

One array per layer:

    kv_pages: [num_pages, num_kv_heads, 2, page_size, head_dim]     (axis 2: 0 = K, 1 = V)

Why this order: the tile a kernel streams for one (page, kv head) is `kv_pages[page, head]`, a
contiguous [2, page_size, head_dim] block holding both K and V. One bulk copy (TMA on Hopper)
fetches it, every GMEM stride but the last is a multiple of 16 bytes for head_dim >= 8, and tensor
parallelism shards axis 1 (kv heads) without touching the page axis.

**fp8 pages store V transposed.** The page_size x head_dim bytes of `kv_pages[page, head, 1]`
hold V^T, [head_dim, page_size] row-major (`v_transposed(dtype)`; `values_view` gives the array
that shape, a free reshape). Hopper's fp8 wgmma takes both operands K-major only: for P V the
contraction runs over tokens, so V must be stored token-contiguous to be read as it lands, with
no conversion or transpose in the kernel (mgpu_consumer.py). K stays [page_size, head_dim]: for
Q K^T head_dim is the contraction and rows are already K-major. `split_kv` and `join_kv` convert
between the stored form and logical [page_size, head_dim] K and V for every reader and writer
outside the kernel.

Page 0 is the null page: padded tokens write into it and padded page-table entries point at it.
It is never handed to a request, so its contents are garbage by design and never read unmasked.

A token's slot is `page * page_size + offset`; `slot_mapping[T]` carries one slot per step token.

Page dtype (`kv_cache_dtype`, vLLM's names): "auto" stores the model's dtype; "fp8" / "fp8_e4m3"
store float8_e4m3fn and "fp8_e5m2" float8_e5m2, one byte per value, with two float32 scales per
layer, `kv_scales = [k_scale, v_scale]`: a stored value x means x * scale. The write divides by
the scale, saturates to the format's largest finite value (448 for e4m3, 57,344 for e5m2) and
rounds to nearest even; readers multiply back (the kernel folds k_scale into the softmax scale and
v_scale into the output's normalisation). Scales: DEFAULT_KV_SCALE (1.0, as vLLM) or
`calibrate_kv_scales` (max |x| over sample K/V, mapped to the format's largest value).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.page_constants import (  # noqa: F401 (re-exported)
    KV_CACHE_DTYPES,
    NULL_PAGE,
    stored_kv_heads,
)

K_INDEX = 0
V_INDEX = 1

FP8_DTYPES = {"fp8": jnp.float8_e4m3fn, "fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2}
assert KV_CACHE_DTYPES == ("auto", *FP8_DTYPES)
DEFAULT_KV_SCALE = 1.0


def kv_page_dtype(kv_cache_dtype: str, model_dtype) -> jnp.dtype:
    """The dtype a layer's page array is allocated in."""
    if kv_cache_dtype == "auto":
        return jnp.dtype(model_dtype)
    if kv_cache_dtype not in FP8_DTYPES:
        raise ValueError(f"{kv_cache_dtype=} must be one of {KV_CACHE_DTYPES}")
    return jnp.dtype(FP8_DTYPES[kv_cache_dtype])


def is_fp8(dtype) -> bool:
    return jnp.dtype(dtype) in (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def default_kv_scales() -> jax.Array:
    """f32[2] (k_scale, v_scale) of DEFAULT_KV_SCALE."""
    return jnp.full((2,), DEFAULT_KV_SCALE, jnp.float32)


def calibrate_kv_scales(k: jax.Array, v: jax.Array, dtype) -> jax.Array:
    """f32[2] scales that map the largest |value| of sample K and V (any shape; e.g. a
    prompt's keys and values of one layer) onto the fp8 format's largest finite value; 1.0 for an
    all-zero sample."""
    top = jnp.finfo(dtype).max.astype(jnp.float32)
    amax = jnp.stack([jnp.max(jnp.abs(x.astype(jnp.float32))) for x in (k, v)])
    return jnp.where(amax > 0, amax / top, 1.0)


def quantize_kv(x: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """x / scale in `dtype` (fp8), saturated to its largest finite value, rounded to nearest
    even."""
    top = float(jnp.finfo(dtype).max)
    return jnp.clip(x.astype(jnp.float32) / scale, -top, top).astype(dtype)


def dequantize_kv(x: jax.Array, scale: jax.Array) -> jax.Array:
    """Stored values back to float32: x * scale."""
    return x.astype(jnp.float32) * scale


def v_transposed(dtype) -> bool:
    """Whether pages of this dtype store each page's V as V^T [head_dim, page_size] (fp8 pages;
    module docstring)."""
    return is_fp8(dtype)


def values_view(kv_pages: jax.Array) -> jax.Array:
    """[..., 2, PS, D] pages as [..., 2, D, PS]: a free reshape; for V^T pages (v_transposed)
    index 1 of axis -3 is then V^T as stored. (Index 0, K, is meaningless in this view.)"""
    *lead, two, ps, d = kv_pages.shape
    return kv_pages.reshape(*lead, two, d, ps)


def split_kv(kv: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Stored pages [..., 2, PS, D] (any leading axes) into logical (K, V), each [..., PS, D],
    undoing the V^T of fp8 pages."""
    k = kv[..., K_INDEX, :, :]
    if not v_transposed(kv.dtype):
        return k, kv[..., V_INDEX, :, :]
    return k, jnp.swapaxes(values_view(kv)[..., V_INDEX, :, :], -1, -2)


def join_kv(k: jax.Array, v: jax.Array) -> jax.Array:
    """Logical K and V [..., PS, D] (of the pages' dtype) into the stored form [..., 2, PS, D]:
    split_kv's inverse."""
    if v_transposed(v.dtype):
        v = jnp.swapaxes(v, -1, -2).reshape(v.shape)  # V^T's bytes in a [PS, D]-shaped slot
    return jnp.stack([k, v], axis=-3)


def quantize_pages(kv: jax.Array, scales: jax.Array, dtype) -> jax.Array:
    """Logical pages [..., 2, PS, D] (K, V of any float dtype) as stored fp8 pages of `dtype`
    (quantize_kv with scales = (k_scale, v_scale), then join_kv)."""
    k, v = (quantize_kv(kv[..., i, :, :], scales[i], dtype) for i in (K_INDEX, V_INDEX))
    return join_kv(k, v)


def dequantize_pages(pages: jax.Array, scales: jax.Array) -> jax.Array:
    """Stored fp8 pages back to logical float32 [..., 2, PS, D]: quantize_pages' inverse up to
    rounding."""
    k, v = split_kv(pages)
    return jnp.stack([dequantize_kv(k, scales[K_INDEX]), dequantize_kv(v, scales[V_INDEX])], -3)


def check_kv_scales(kv_pages: jax.Array, kv_scales: jax.Array | None) -> None:
    """kv_scales: None (the default scales) or f32[2] for fp8 pages; None for any other pages."""
    if kv_scales is None:
        return
    if not is_fp8(kv_pages.dtype):
        raise ValueError(f"kv_scales apply to fp8 pages only, not {kv_pages.dtype=}")
    if kv_scales.shape != (2,) or kv_scales.dtype != jnp.float32:
        raise ValueError(f"{kv_scales.shape=} {kv_scales.dtype=} must be float32 (2,): (k, v)")


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


def _check_write_inputs(
    kv_pages: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array, kv_scales
):
    if kv_pages.ndim != 5 or kv_pages.shape[2] != 2:
        raise ValueError(
            f"{kv_pages.shape=} must be [num_pages, num_kv_heads, 2, page_size, head_dim]"
        )
    _, hkv, _, _, d = kv_pages.shape
    if k.shape != v.shape or k.ndim != 3 or k.shape[1:] != (hkv, d):
        raise ValueError(f"{k.shape=} and {v.shape=} must both be [T, {hkv}, {d}]")
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"{slot_mapping.shape=} must be ({k.shape[0]},)")
    check_kv_scales(kv_pages, kv_scales)


def _stored(kv_pages: jax.Array, k: jax.Array, v: jax.Array, kv_scales):
    """k and v as the pages store them (quantized for fp8 pages)."""
    if not is_fp8(kv_pages.dtype):
        return k.astype(kv_pages.dtype), v.astype(kv_pages.dtype)
    scales = default_kv_scales() if kv_scales is None else kv_scales
    return (quantize_kv(x, scales[i], kv_pages.dtype) for i, x in ((K_INDEX, k), (V_INDEX, v)))


def write_kv_reference(
    kv_pages: jax.Array,  # [P, Hkv, 2, PS, D]
    k: jax.Array,  # [T, Hkv, D]
    v: jax.Array,  # [T, Hkv, D]
    slot_mapping: jax.Array,  # int32[T]
    kv_scales: jax.Array | None = None,  # f32[2] (fp8 pages; None: the default scales)
    unique_indices: bool = False,
) -> jax.Array:
    """Scatter the step's K/V into their slots. Padding tokens target page 0 and may collide.

    `unique_indices` tells XLA the slots are distinct, which lets its GPU scatter store instead
    of updating atomically (a sub-word value is otherwise a compare-and-swap loop on its word).
    Only the padding tokens break the promise, all into page 0, whose contents are garbage by
    design. The engine sets it (`write_kv_step`): on an H100 the fp8 pages' write of 256 decode
    rows (8 kv heads x 128) took 7.0 us with it against 14.7 without, an 8,192-token chunk 159
    against 207 us (docs/benchmarks.md, "The KV write")."""
    _check_write_inputs(kv_pages, k, v, slot_mapping, kv_scales)
    page_size = kv_pages.shape[3]
    pages = slot_mapping // page_size
    offsets = slot_mapping % page_size
    k, v = _stored(kv_pages, k, v, kv_scales)
    how = dict(mode="promise_in_bounds", unique_indices=unique_indices)
    if v_transposed(kv_pages.dtype):
        # K rows as usual; V as a column of V^T (values_view), D values a page_size apart.
        kv_pages = kv_pages.at[pages, :, K_INDEX, offsets, :].set(k, **how)
        view = values_view(kv_pages).at[pages, :, V_INDEX, :, offsets]
        return view.set(v, **how).reshape(kv_pages.shape)
    kv = jnp.stack([k, v], axis=2)  # [T, Hkv, 2, D]
    # Advanced indices on axes 0 and 3 are separated by slices, so the indexed dims go first: the
    # update has shape [T, Hkv, 2, D], exactly `kv`.
    return kv_pages.at[pages, :, :, offsets, :].set(kv, **how)


def _as_words(x: jax.Array, per_word: int) -> jax.Array:
    """[..., D] of a narrow dtype as u32[..., D / per_word]: a bitcast, no data moves."""
    return lax.bitcast_convert_type(x.reshape(*x.shape[:-1], -1, per_word), jnp.uint32)


def write_kv_packed(
    kv_pages: jax.Array,  # [P, Hkv, 2, PS, D]
    k: jax.Array,  # [T, Hkv, D]
    v: jax.Array,  # [T, Hkv, D]
    slot_mapping: jax.Array,  # int32[T]
    kv_scales: jax.Array | None = None,  # f32[2] (fp8 pages; None: the default scales)
    unique_indices: bool = False,  # as write_kv_reference's
) -> jax.Array:
    """write_kv_reference's pages, with the scatter moving 32-bit words instead of 16-bit (or
    8-bit) values: the pages and the update bitcast to u32 (head_dim / 2 words per row for bf16)
    and back, free reshapes on both sides.

    Why: XLA's GPU scatter of bf16 elements wrote at about 250 GB/s on the H200, 131 us per layer
    for an 8,192-token chunk (32q/8kv/128), and the same scatter of u32 words takes 19.5 us
    (docs/benchmarks.md, "The KV write"). The page layout, and with it the kv-head sharding of
    axis 1, is unchanged. 32-bit pages, and rows that are not a whole number of words, take the
    reference scatter. V^T pages (fp8, v_transposed) write K's rows as words and V's columns
    value by value: a token's V values lie page_size bytes apart there.
    """
    _check_write_inputs(kv_pages, k, v, slot_mapping, kv_scales)
    itemsize = jnp.dtype(kv_pages.dtype).itemsize
    per_word = 4 // itemsize if itemsize < 4 else 1
    if per_word == 1 or kv_pages.shape[-1] % per_word:
        return write_kv_reference(kv_pages, k, v, slot_mapping, kv_scales, unique_indices)
    k, v = _stored(kv_pages, k, v, kv_scales)
    how = dict(mode="promise_in_bounds", unique_indices=unique_indices)

    def from_words(words):  # [..., D / per_word] u32 back to the pages' dtype and shape
        out = lax.bitcast_convert_type(words, kv_pages.dtype)  # [..., D / per_word, per_word]
        return out.reshape(kv_pages.shape)

    if not v_transposed(kv_pages.dtype):
        words = write_kv_reference(
            _as_words(kv_pages, per_word),
            _as_words(k, per_word),
            _as_words(v, per_word),
            slot_mapping,
            unique_indices=unique_indices,
        )
        return from_words(words)
    page_size = kv_pages.shape[3]
    pages, offsets = slot_mapping // page_size, slot_mapping % page_size
    words = _as_words(kv_pages, per_word).at[pages, :, K_INDEX, offsets, :]
    kv_pages = from_words(words.set(_as_words(k, per_word), **how))
    view = values_view(kv_pages).at[pages, :, V_INDEX, :, offsets]
    return view.set(v, **how).reshape(kv_pages.shape)


def write_kv_step(
    kv_pages: jax.Array,
    k: jax.Array,
    v: jax.Array,
    slot_mapping: jax.Array,
    kv_scales: jax.Array | None = None,
) -> jax.Array:
    """The engine's write of one step's K/V, its slots promised distinct (a step writes each slot
    once; only its padding tokens share page 0's, see `write_kv_reference`): 32-bit words
    (`write_kv_packed`), except on V^T pages (fp8), where K's words saved less than their
    conversion cost once both scatters store plainly (H100: 7.0 against 8.3 us for 256 decode
    rows, 159 against 164 us for 8,192 tokens, 8 kv heads x 128; docs/benchmarks.md)."""
    write = write_kv_reference if v_transposed(kv_pages.dtype) else write_kv_packed
    return write(kv_pages, k, v, slot_mapping, kv_scales, unique_indices=True)


# Jitted, donating KV write (in place); inside the engine's step `write_kv_step` is inlined.
write_kv = jax.jit(write_kv_step, donate_argnums=(0,))
