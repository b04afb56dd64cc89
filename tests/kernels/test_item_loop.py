"""The kernel's per-item loop (both roles walk it): which items a CTA takes (the snake order), each
with its own descriptor, and how many."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.ragged_paged_attention.mgpu_items import (
    for_each_item,
    snake_count,
    snake_item,
)


@dataclasses.dataclass
class FakeItems:
    """Items with 10 work items and the kernel's item order; describe(w) is a recognisable
    function of w (clamped past the end, as the real one is)."""

    num_items: int = 10

    def item_at(self, cta, i, num_ctas):
        return snake_item(cta, i, num_ctas)

    def count_for(self, cta, num_ctas):
        return snake_count(jnp.int32(self.num_items), cta, num_ctas)

    def describe(self, w):
        w = jnp.minimum(w, self.num_items - 1)
        return {"seq": 100 + w, "b0": 2 * w, "b1": 2 * w + 3, "unused": -w}


@pytest.mark.parametrize(
    "cta, expected_items",
    [(0, [0, 7, 8]), (2, [2, 5]), (3, [3, 4])],  # rounds 0-3, 7-4 (reversed), then 8, 9
)
def test_each_item_sees_its_own_descriptor(cta: int, expected_items: list[int]) -> None:
    num_ctas = 4
    items = FakeItems()

    def body(i, w, it, seen):  # record (w, seq, b0, b1) of the i-th item
        return seen.at[i].set(jnp.stack([w, it["seq"], it["b0"], it["b1"]]))

    run = jax.jit(
        lambda: for_each_item(
            items, jnp.int32(cta), num_ctas, ("seq", "b0", "b1"), body, jnp.zeros((4, 4), jnp.int32)
        )
    )
    seen, n = run()
    expected = [[w, 100 + w, 2 * w, 2 * w + 3] for w in expected_items]
    assert int(n) == len(expected)
    assert seen[: len(expected)].tolist() == expected


@pytest.mark.parametrize("num_ctas", [1, 3, 4, 132])
@pytest.mark.parametrize("num_items", [0, 1, 3, 4, 5, 131, 132, 133, 390, 1368])
def test_snake_takes_every_item_once(num_items: int, num_ctas: int) -> None:
    taken = []
    for cta in range(num_ctas):
        n = int(snake_count(jnp.int32(num_items), jnp.int32(cta), num_ctas))
        ws = [int(snake_item(jnp.int32(cta), jnp.int32(i), num_ctas)) for i in range(n)]
        assert ws == sorted(ws)  # a CTA walks its items in list order
        # The producer finds a Q slot's previous item two rounds back.
        assert all(b - a == 2 * num_ctas for a, b in zip(ws, ws[2:], strict=False))
        taken += ws
    assert sorted(taken) == list(range(num_items))


def test_snake_balances_longest_first_items() -> None:
    """Items longest first (work num_items - w): with about three per CTA, plain round-robin
    gives CTA 0 twice the work of the last CTA; the snake keeps the spread within one item."""
    num_items, num_ctas = 390, 132
    work = []
    for cta in range(num_ctas):
        n = int(snake_count(jnp.int32(num_items), jnp.int32(cta), num_ctas))
        work.append(
            sum(
                num_items - int(snake_item(jnp.int32(cta), jnp.int32(i), num_ctas))
                for i in range(n)
            )
        )
    round_robin = [sum(range(num_items - cta, 0, -num_ctas)) for cta in range(num_ctas)]
    assert max(round_robin) / min(round_robin) > 1.9
    assert max(work) - min(work) < num_items
