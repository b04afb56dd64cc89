"""The step's K/V into the pages: the packed scatter the engine uses against a plain loop."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kv_layout import KVLayout, write_kv, write_kv_packed, write_kv_reference


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

    expected = np.array(pages)
    for tok, slot in enumerate(slots[: t - 3]):
        page, offset = divmod(int(slot), page_size)
        expected[page, :, 0, offset] = np.asarray(k[tok])
        expected[page, :, 1, offset] = np.asarray(v[tok])

    for write in (write_kv_packed, write_kv_reference):
        got = np.asarray(write(pages, k, v, jnp.asarray(slots)))
        # Page 0 takes the padding tokens' colliding writes: garbage by design (kv_layout.py).
        np.testing.assert_array_equal(got[1:], expected[1:])


def test_jitted_donating_write_matches_the_reference():
    """write_kv as the engine's step would call it, with float32 K/V cast into bf16 pages."""
    layout = KVLayout(num_pages=5, num_kv_heads=2, page_size=16, head_dim=32)
    rng = np.random.default_rng(3)
    pages = jnp.asarray(rng.standard_normal(layout.shape), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((20, 2, 32)), jnp.float32) for _ in "kv")
    slots = jnp.asarray(_slots(rng, 5, 16, num_valid=20, num_tokens=20))
    expected = np.asarray(write_kv_reference(pages, k, v, slots))
    np.testing.assert_array_equal(np.asarray(write_kv(pages, k, v, slots)), expected)


def test_bad_shapes_name_the_value():
    pages = jnp.zeros(KVLayout(num_pages=3, num_kv_heads=2, page_size=4, head_dim=8).shape)
    k = jnp.zeros((5, 2, 8))
    with pytest.raises(ValueError, match="slot_mapping.shape"):
        write_kv_packed(pages, k, k, jnp.zeros((4,), jnp.int32))
    with pytest.raises(ValueError, match="k.shape"):
        write_kv_packed(pages, k[:, :1], k[:, :1], jnp.zeros((5,), jnp.int32))
