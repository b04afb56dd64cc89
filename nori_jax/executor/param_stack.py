"""The forward pass's parameters stacked by kind: one `[n, ...]` array per weight kind, not one
array per layer and kind.

A launch pays host time for every input buffer (about 1.6 us each on the H200: docs/benchmarks.md,
"The per-buffer cost of a launch"), and a decoder's parameters are the same few kinds repeated in
every layer: the SmolLM2-135M shape passes 272 parameter arrays, 11 once stacked. Inside the
compiled forward pass each layer's weight is a static slice of its stack, which XLA reads in place
(on the H200 a decoder-shaped chain of matmuls copied none of the slices and ran faster).

Leaves are stacked when they agree on shape, dtype and sharding (the stack's sharding is theirs
with a leading unsplit axis); a leaf alike to no other stays as it is. The KV pages are not
parameters and stay one array per layer: stacked, XLA copies a layer's pages around every write.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec, Sharding


@dataclasses.dataclass(frozen=True)
class StackLayout:
    """Where each original leaf lives: `slots[i] = (stack, row)`, row None for a leaf kept as is.
    Static (hashable): the compiled forward pass closes over it."""

    slots: tuple[tuple[int, int | None], ...]

    def unstack(self, stacks: Sequence[jax.Array]) -> list[jax.Array]:
        """The original leaves, in order: inside jit, static slices of the stacks."""
        return [stacks[s] if row is None else stacks[s][row] for s, row in self.slots]

    @property
    def num_leaves(self) -> int:
        return len(self.slots)


def _stacked_sharding(sharding: Sharding) -> Sharding:
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec(None, *sharding.spec))
    return sharding  # one device: the stack lives where its rows did


def _row_sharding(sharding: Sharding) -> Sharding:
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec[1:]))
    return sharding


def _key(x: jax.Array):
    return x.shape, jnp.dtype(x.dtype), x.sharding


def stack_leaves(leaves: Sequence[jax.Array]) -> tuple[list[jax.Array], StackLayout]:
    """Stack `leaves` by kind. The stacked leaves are deleted as each stack is built, so the peak
    is the parameters plus one stack, and the caller must not use them again."""
    groups: dict[tuple, list[int]] = {}
    for i, x in enumerate(leaves):
        groups.setdefault(_key(x), []).append(i)
    stacks: list[jax.Array] = []
    slots: list[tuple[int, int | None] | None] = [None] * len(leaves)
    for members in groups.values():
        s = len(stacks)
        if len(members) == 1:
            stacks.append(leaves[members[0]])
            slots[members[0]] = (s, None)
            continue
        group = [leaves[i] for i in members]
        sharding = _stacked_sharding(group[0].sharding)
        stack = jax.jit(lambda *xs: jnp.stack(xs), out_shardings=sharding)
        stacks.append(stack(*group))
        for row, (i, x) in enumerate(zip(members, group, strict=True)):
            slots[i] = (s, row)
            if not x.is_deleted():  # the same array twice in a tree is one buffer
                x.delete()
    return stacks, StackLayout(tuple(slots))


def unstacked_copy(stacks: Sequence[jax.Array], layout: StackLayout) -> list[jax.Array]:
    """The original leaves as new arrays, each on its original sharding (a copy of the stacked
    rows: for inspection, not for the step loop)."""
    takes = {}  # one compiled row copy per stack (the row is an argument, not a constant)
    out = []
    for s, row in layout.slots:
        x = stacks[s]
        if row is None:
            out.append(x)
            continue
        if s not in takes:
            take = lambda a, r: jax.lax.dynamic_index_in_dim(a, r, 0, keepdims=False)  # noqa: E731
            takes[s] = jax.jit(take, out_shardings=_row_sharding(x.sharding))
        out.append(takes[s](x, row))
    return out
