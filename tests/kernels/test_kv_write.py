"""The step's K/V into the pages: the packed scatter the engine uses against a plain loop; fp8
pages: quantization and its round trip on hand-made values."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kv_layout import (
    KVLayout,
    calibrate_kv_scales,
    dequantize_kv,
    join_kv,
    kv_page_dtype,
    quantize_kv,
    split_kv,
    values_view,
    write_kv,
    write_kv_packed,
    write_kv_reference,
)


def _slots(rng, num_pages: int, page_size: int, num_valid: int, num_tokens: int) -> np.ndarray:
    """Distinct slots outside the null page for the valid tokens; padding tokens (the rest)
    all target slot 0, the null page, as the engine pads."""
    free = rng.permutation(np.arange(page_size, num_pages * page_size))[:num_valid]
    return np.concatenate([free, np.zeros(num_tokens - num_valid, np.int64)]).astype(np.int32)


@pytest.mark.parametrize(
    "page_size, num_kv_heads, head_dim, dtype",
    [
        (16, 2, 64, jnp.bfloat16),
        (64, 3, 128, jnp.float16),
        (1, 1, 8, jnp.float32),  # 32-bit pages: the reference scatter
        (16, 2, 8, jnp.float8_e4m3fn),  # four values per word
        (4, 1, 3, jnp.bfloat16),  # rows that are not whole words: the reference scatter
    ],
)
def test_packed_scatter_writes_every_slot_like_a_loop(page_size, num_kv_heads, head_dim, dtype):
    layout = KVLayout(
        num_pages=9, num_kv_heads=num_kv_heads, page_size=page_size, head_dim=head_dim
    )
    rng = np.random.default_rng(page_size)
    pages = jnp.asarray(rng.standard_normal(layout.shape), dtype)
    t = 2 * page_size + 3
    k, v = (jnp.asarray(rng.standard_normal((t, num_kv_heads, head_dim)), dtype) for _ in "kv")
    slots = _slots(rng, layout.num_pages, page_size, num_valid=t - 3, num_tokens=t)

    # logical K and V (split_kv: fp8 pages store V transposed)
    expected = np.array(jnp.stack(split_kv(pages), axis=2))
    for tok, slot in enumerate(slots[: t - 3]):
        page, offset = divmod(int(slot), page_size)
        expected[page, :, 0, offset] = np.asarray(k[tok])
        expected[page, :, 1, offset] = np.asarray(v[tok])

    for write in (write_kv_packed, write_kv_reference):
        for unique in (False, True):  # the slots are distinct but in page 0 (padding)
            written = write(pages, k, v, jnp.asarray(slots), unique_indices=unique)
            got = np.asarray(jnp.stack(split_kv(written), axis=2))
            # Page 0 takes the padding tokens' colliding writes: garbage by design (kv_layout.py).
            np.testing.assert_array_equal(got[1:], expected[1:])


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_v_transposed_pages_hold_every_token_of_a_chunk(page_size, dtype):
    """fp8 pages (K rows as words, V^T columns): chunks that start and end inside a 32-bit word
    and cross a page, a lone decode token, padding into the null page, in the engine's order and
    shuffled; byte for byte the value-by-value reference."""
    layout = KVLayout(num_pages=12, num_kv_heads=2, page_size=page_size, head_dim=16)
    rng = np.random.default_rng(7)
    pages = jnp.asarray(rng.standard_normal(layout.shape), dtype)
    ps = page_size
    slots = np.array(
        [3 * ps + 5 + i for i in range(ps + 3)]  # from mid-word, across pages 3 -> 4
        + [7 * ps + 2]  # a decode token
        + [9 * ps + i for i in range(6)]  # a chunk from a page's start, a partial last word
        + [0] * 5,  # padding
        np.int32,
    )
    k, v = (jnp.asarray(rng.standard_normal((len(slots), 2, 16)), jnp.float32) for _ in "kv")
    for order in (np.arange(len(slots)), rng.permutation(len(slots))):
        args = (k[order], v[order], jnp.asarray(slots[order]))
        got = np.asarray(write_kv_packed(pages, *args)[1:]).view(np.uint8)
        want = np.asarray(write_kv_reference(pages, *args)[1:]).view(np.uint8)
        np.testing.assert_array_equal(got, want)


def test_jitted_donating_write_matches_the_reference():
    """write_kv as the engine's step would call it, with float32 K/V cast into bf16 pages."""
    layout = KVLayout(num_pages=5, num_kv_heads=2, page_size=16, head_dim=32)
    rng = np.random.default_rng(3)
    pages = jnp.asarray(rng.standard_normal(layout.shape), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((20, 2, 32)), jnp.float32) for _ in "kv")
    slots = jnp.asarray(_slots(rng, 5, 16, num_valid=20, num_tokens=20))
    expected = np.asarray(write_kv_reference(pages, k, v, slots))
    np.testing.assert_array_equal(np.asarray(write_kv(pages, k, v, slots)), expected)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
def test_engine_write_promises_distinct_slots_to_every_scatter(dtype):
    """The layer's write (attention_step, write_kv) lowers every scatter with unique_indices,
    which lets XLA's GPU scatter store instead of updating atomically (docs/benchmarks.md)."""
    import jax

    from pallas_kernels.ragged_paged_attention import attention_step

    layout = KVLayout(num_pages=4, num_kv_heads=1, page_size=16, head_dim=64)
    pages = jnp.zeros(layout.shape, dtype)
    k = v = jnp.ones((8, 1, 64), jnp.bfloat16)
    slots = jnp.arange(16, 24, dtype=jnp.int32)
    q = jnp.ones((8, 2, 64), jnp.bfloat16)
    meta = (
        jnp.array([8], jnp.int32),
        jnp.array([[1, 2]], jnp.int32),
        jnp.array([0, 8], jnp.int32),
        jnp.array([0, 1], jnp.int32),
    )
    step = functools.partial(attention_step, sm_scale=0.125)
    for text in (
        write_kv.lower(pages, k, v, slots).as_text(),
        jax.jit(step).lower(q, k, v, pages, slots, *meta).as_text(),
    ):
        scatters = [line for line in text.splitlines() if "stablehlo.scatter" in line]
        assert scatters and all("unique_indices = true" in line for line in scatters), scatters


def test_bad_shapes_name_the_value():
    pages = jnp.zeros(KVLayout(num_pages=3, num_kv_heads=2, page_size=4, head_dim=8).shape)
    k = jnp.zeros((5, 2, 8))
    with pytest.raises(ValueError, match="slot_mapping.shape"):
        write_kv_packed(pages, k, k, jnp.zeros((4,), jnp.int32))
    with pytest.raises(ValueError, match="k.shape"):
        write_kv_packed(pages, k[:, :1], k[:, :1], jnp.zeros((5,), jnp.int32))


# fp8 pages (kv_layout.py): values / scale, saturated, rounded to nearest even; x * scale back.
E4M3_CASES = [  # (value, scale, stored value)
    (0.0, 1.0, 0.0),
    (1.0, 1.0, 1.0),
    (-1.0, 1.0, -1.0),
    (0.3, 1.0, 0.3125),  # 1.2 x 2^-2: 1.25 is nearer than 1.125
    (1.0625, 1.0, 1.0),  # halfway between 1.0 and 1.125: the even mantissa
    (1.1875, 1.0, 1.25),  # halfway between 1.125 and 1.25: the even mantissa
    (2.0**-9, 1.0, 2.0**-9),  # the smallest subnormal
    (448.0, 1.0, 448.0),  # the largest finite value
    (500.0, 1.0, 448.0),  # saturates (e4m3fn has no infinity)
    (-1e9, 1.0, -448.0),
    (3.0, 2.0, 1.5),
    (-7.0, 0.5, -14.0),
]
E5M2_CASES = [
    (1.0, 1.0, 1.0),
    (500.0, 1.0, 512.0),  # two mantissa bits: 448 or 512, 512 is nearer
    (57344.0, 1.0, 57344.0),  # the largest finite value
    (1e6, 1.0, 57344.0),  # saturates instead of becoming infinity
    (0.3, 1.0, 0.3125),
    (6.0, 4.0, 1.5),
]


@pytest.mark.parametrize(
    "dtype, cases", [(jnp.float8_e4m3fn, E4M3_CASES), (jnp.float8_e5m2, E5M2_CASES)]
)
def test_quantize_dequantize_exact_values(dtype, cases):
    x = jnp.asarray([c[0] for c in cases], jnp.float32)
    scale = jnp.asarray([c[1] for c in cases], jnp.float32)
    stored = quantize_kv(x, scale, dtype)
    assert stored.dtype == dtype
    np.testing.assert_array_equal(np.asarray(stored, np.float32), [c[2] for c in cases])
    back = dequantize_kv(stored, scale)
    np.testing.assert_array_equal(np.asarray(back), [c[2] * c[1] for c in cases])


def test_calibrated_scales_map_the_largest_value_onto_the_format():
    k = jnp.asarray([[0.5, -896.0], [3.0, 1.0]])
    v = jnp.zeros((2, 2))
    np.testing.assert_array_equal(np.asarray(calibrate_kv_scales(k, v, jnp.float8_e4m3fn)), [2, 1])
    scales = calibrate_kv_scales(k, k * 0.25, jnp.float8_e5m2)
    np.testing.assert_allclose(np.asarray(scales), [896 / 57344, 224 / 57344])
    # With calibrated scales nothing saturates: the extremes come back exactly.
    assert float(dequantize_kv(quantize_kv(k[0, 1], scales[0], jnp.float8_e5m2), scales[0])) == -896


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_fp8_write_stores_quantized_values_in_every_slot(dtype):
    """write_kv_packed (the engine's form) and write_kv_reference quantize K with k_scale and V
    with v_scale; without scales, DEFAULT_KV_SCALE."""
    layout = KVLayout(num_pages=6, num_kv_heads=2, page_size=16, head_dim=32)
    rng = np.random.default_rng(5)
    pages = jnp.asarray(rng.standard_normal(layout.shape), dtype)
    t = 21
    k, v = (jnp.asarray(rng.standard_normal((t, 2, 32)) * 40, jnp.bfloat16) for _ in "kv")
    slots = jnp.asarray(_slots(rng, 6, 16, num_valid=t - 2, num_tokens=t))
    for scales in (jnp.asarray([0.25, 4.0], jnp.float32), None):
        ks, vs = (1.0, 1.0) if scales is None else (0.25, 4.0)
        # fp8 pages store V transposed: a token's V is a column of the page's V^T [D, PS]
        expected = np.array(pages.astype(jnp.float32))
        expected_vt = np.array(values_view(pages).astype(jnp.float32))
        for tok, slot in enumerate(np.asarray(slots)[: t - 2]):
            page, offset = divmod(int(slot), 16)
            expected[page, :, 0, offset] = np.asarray(quantize_kv(k[tok], ks, dtype), np.float32)
            expected_vt[page, :, 1, :, offset] = np.asarray(quantize_kv(v[tok], vs, dtype))
        for write in (write_kv_packed, write_kv_reference):
            got = write(pages, k, v, slots, scales)
            assert got.dtype == dtype
            np.testing.assert_array_equal(np.asarray(got[1:, :, 0], np.float32), expected[1:, :, 0])
            got_vt = np.asarray(values_view(got)[1:, :, 1], np.float32)
            np.testing.assert_array_equal(got_vt, expected_vt[1:, :, 1])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_split_and_join_kv_are_inverse_and_transpose_only_fp8_values(dtype):
    """join_kv lays logical K, V [..., PS, D] out as the pages store them (fp8: V's bytes as
    V^T [D, PS]); split_kv reads them back."""
    rng = np.random.default_rng(3)
    k, v = (jnp.asarray(rng.standard_normal((3, 2, 4, 8)), dtype) for _ in "kv")  # PS 4, D 8
    stored = join_kv(k, v)
    assert stored.shape == (3, 2, 2, 4, 8) and stored.dtype == dtype
    got_k, got_v = split_kv(stored)
    np.testing.assert_array_equal(np.asarray(got_k, np.float32), np.asarray(k, np.float32))
    np.testing.assert_array_equal(np.asarray(got_v, np.float32), np.asarray(v, np.float32))
    v_bytes = np.asarray(stored[:, :, 1], np.float32)
    if dtype == jnp.bfloat16:
        np.testing.assert_array_equal(v_bytes, np.asarray(v, np.float32))
    else:  # [PS, D]'s slot holds V^T's bytes: value (token 1, dim 0) sits at flat index 0 * 4 + 1
        vt = np.swapaxes(np.asarray(v, np.float32), -1, -2).reshape(v.shape)
        np.testing.assert_array_equal(v_bytes, vt)
        assert v_bytes.reshape(3, 2, -1)[0, 0, 1] == float(v[0, 0, 1, 0])


def test_page_dtype_names_and_scale_errors():
    assert kv_page_dtype("auto", jnp.bfloat16) == jnp.bfloat16
    assert kv_page_dtype("fp8", jnp.bfloat16) == jnp.float8_e4m3fn
    assert kv_page_dtype("fp8_e4m3", jnp.float16) == jnp.float8_e4m3fn
    assert kv_page_dtype("fp8_e5m2", jnp.float32) == jnp.float8_e5m2
    with pytest.raises(ValueError, match="kv_cache_dtype='int8'"):
        kv_page_dtype("int8", jnp.bfloat16)
    k = jnp.zeros((5, 2, 8))
    slots = jnp.zeros((5,), jnp.int32)
    bf16_pages = jnp.zeros((3, 2, 2, 4, 8), jnp.bfloat16)
    with pytest.raises(ValueError, match="fp8 pages only"):
        write_kv_packed(bf16_pages, k, k, slots, jnp.ones(2, jnp.float32))
    fp8_pages = bf16_pages.astype(jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="kv_scales.shape"):
        write_kv_packed(fp8_pages, k, k, slots, jnp.ones(3, jnp.float32))
