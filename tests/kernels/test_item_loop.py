"""The kernel's per-item loop (both roles walk it) hands each of a CTA's items its own descriptor,
and counts them."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.ragged_paged_attention.mgpu_items import for_each_item


@dataclasses.dataclass
class FakeItems:
    """Items with 10 work items; describe(w) is a recognisable function of w (clamped past the
    end, as the real one is)."""

    num_items: int = 10

    def count_for(self, cta, num_ctas):
        return jnp.maximum(self.num_items - cta + num_ctas - 1, 0) // num_ctas

    def describe(self, w):
        w = jnp.minimum(w, self.num_items - 1)
        return {"seq": 100 + w, "b0": 2 * w, "b1": 2 * w + 3, "unused": -w}


@pytest.mark.parametrize("cta", [0, 2, 3])
def test_each_item_sees_its_own_descriptor(cta: int) -> None:
    num_ctas = 4
    items = FakeItems()

    def body(i, it, seen):  # record (w, seq, b0, b1) of the i-th item
        w = cta + i * num_ctas
        return seen.at[i].set(jnp.stack([w, it["seq"], it["b0"], it["b1"]]))

    run = jax.jit(
        lambda: for_each_item(
            items, jnp.int32(cta), num_ctas, ("seq", "b0", "b1"), body, jnp.zeros((4, 4), jnp.int32)
        )
    )
    seen, n = run()
    expected = [[w, 100 + w, 2 * w, 2 * w + 3] for w in range(cta, 10, num_ctas)]
    assert int(n) == len(expected)
    assert seen[: len(expected)].tolist() == expected
