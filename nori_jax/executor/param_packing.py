"""The model's parameters as the forward pass takes them: small vectors stacked into one array.

Each argument of a launch costs the host work in the runtime (a buffer to look up, hold and
hand to the CUDA graph): on the H200 0.75-1.6 us per argument, docs/benchmarks.md, "Host costs".
A Llama-family model has two RMSNorm scales per layer and one at the end, 61 vectors of a few
KiB for SmolLM2-135M's 30 layers, a fifth of the forward pass's ~300 arguments. `PackedParams`
stacks every group of same-shaped 1-D leaves (same dtype and sharding) into one [n, ...] array,
made when the runner starts (and for new weights); the program takes row i where the model reads
the vector, a slice that fuses into the elementwise op that reads it. Weight matrices go in as
they are.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec


class PackedParams:
    """`pack(leaves)`: the launch's parameter arguments; `unflatten(args)` (inside a program): the
    model's parameter tree from them."""

    def __init__(self, leaves: list[jax.Array], treedef):
        self.treedef = treedef
        self.num_leaves = len(leaves)
        groups: dict[tuple, list[int]] = {}
        for i, x in enumerate(leaves):
            if x.ndim == 1 and isinstance(x.sharding, NamedSharding):
                key = (x.shape, x.dtype, x.sharding.mesh, tuple(x.sharding.spec))
                groups.setdefault(key, []).append(i)
        stacked = {key: idx for key, idx in groups.items() if len(idx) > 1}
        in_stack = {i: (key, row) for key, idx in stacked.items() for row, i in enumerate(idx)}
        # Per argument: the leaf it is, or the stack key and its leaves' indices.
        self._args: list[int | tuple[tuple, list[int]]] = []
        # Per leaf: (argument index, row) where the leaf is a row of a stacked argument, or
        # (argument index, None) where it is the argument itself.
        self._where: list[tuple[int, int | None]] = [None] * len(leaves)  # type: ignore[list-item]
        stack_arg: dict[tuple, int] = {}
        for i in range(len(leaves)):
            if i not in in_stack:
                self._where[i] = (len(self._args), None)
                self._args.append(i)
                continue
            key, row = in_stack[i]
            if key not in stack_arg:
                stack_arg[key] = len(self._args)
                self._args.append((key, stacked[key]))
            self._where[i] = (stack_arg[key], row)

    @property
    def num_args(self) -> int:
        return len(self._args)

    def pack(self, leaves: list[jax.Array]) -> list[jax.Array]:
        """The launch's parameter arguments from leaves laid out as the ones this was built on
        (the model's weights, or new weights of the same model: the same programs take them).
        Holds none of them: the programs keep this object, and new weights must free the old."""
        if len(leaves) != self.num_leaves:
            raise ValueError(f"expected {self.num_leaves} parameter leaves, got {len(leaves)}")
        return [
            leaves[arg] if isinstance(arg, int) else _stack([leaves[j] for j in arg[1]], arg[0])
            for arg in self._args
        ]

    @property
    def num_stacked(self) -> int:
        """Leaves that travel inside a stacked argument."""
        return sum(row is not None for _, row in self._where)

    def unflatten(self, args):
        """The parameter tree from the launch's parameter arguments (traced or concrete)."""
        if len(args) != self.num_args:
            raise ValueError(f"expected {self.num_args} parameter arguments, got {len(args)}")
        leaves = [args[a] if row is None else args[a][row] for a, row in self._where]
        return jax.tree.unflatten(self.treedef, leaves)


def _stack(vectors: list[jax.Array], key: tuple) -> jax.Array:
    """The vectors as rows of one array on their own sharding, the new axis whole."""
    _, _, mesh, spec = key
    sharding = NamedSharding(mesh, PartitionSpec(None, *spec))
    return jax.jit(lambda *xs: jnp.stack(xs), out_shardings=sharding)(*vectors)
