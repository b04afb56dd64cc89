"""The model's parameters as the forward pass takes them: same-shaped leaves stacked into one
array.

Each argument of a launch costs the host work in the runtime (a buffer to look up, hold and
hand to the CUDA graph): on the H200 0.75-1.6 us per argument, docs/benchmarks.md, "Host costs".
A Llama-family model has two RMSNorm scales per layer and one at the end, 61 vectors of a few
KiB for SmolLM2-135M's 30 layers, a fifth of the forward pass's ~300 arguments. `PackedParams`
stacks every group of same-shaped 1-D leaves (same dtype and sharding) into one [n, ...] array,
made when the runner starts (and for new weights); the program takes row i where the model reads
the vector, a slice that fuses into the elementwise op that reads it.

With `stack_matrices` (the engine's `stack_weights`) the weight matrices are stacked the same
way, by shape, dtype and sharding: the 135M shape's 122 parameter arrays (four fused matrices a
layer, the embedding, the stacked norm scales) become 7 arguments, the row index included. A
matrix's row is then taken at a *runtime* index (the last argument, int32[n], 0..n-1), not a
constant one, so that every layer's slice-and-matmul is the same HLO: XLA:GPU autotunes each of
its GEMM fusions, and with constant slices (each layer's a different fusion) the forward pass of
the fourteenth session compiled for minutes (with the runtime index it compiles in about the
time of unstacked weights, but XLA:GPU then keeps each row's slice out of its matmul, most
likely a copy: a shorter launch for longer device work, so the engine leaves it off by default;
docs/benchmarks.md, "Stacked weights at a runtime row index"). Stacking copies the weights, so
`pack(..., consume=True)` deletes each leaf once its stack is built (the device then holds the
weights plus one stack, never two copies), and `unpack` gives the leaves back.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec


class PackedParams:
    """`pack(leaves)`: the launch's parameter arguments; `unflatten(args)` (inside a program): the
    model's parameter tree from them; `unpack(args)`: the leaves again, as arrays."""

    def __init__(self, leaves: list[jax.Array], treedef, stack_matrices: bool = False):
        self.treedef = treedef
        self.num_leaves = len(leaves)
        groups: dict[tuple, list[int]] = {}
        for i, x in enumerate(leaves):
            if (x.ndim == 1 or (stack_matrices and x.ndim > 1)) and isinstance(
                x.sharding, NamedSharding
            ):
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
        # The stacks of matrices (rows at a runtime index), and the index argument's length and
        # sharding (replicated on the stacks' mesh).
        self._matrix_stacks = {
            a for a, arg in enumerate(self._args) if not isinstance(arg, int) and len(arg[0][0]) > 1
        }
        self._num_rows = max((len(self._args[a][1]) for a in self._matrix_stacks), default=0)
        self._rows_sharding = next(
            (NamedSharding(self._args[a][0][2], PartitionSpec()) for a in self._matrix_stacks),
            None,
        )

    @property
    def num_args(self) -> int:
        return len(self._args) + bool(self._matrix_stacks)

    @property
    def stacked_leaves(self) -> list[int]:
        """The leaves that travel as rows of a stacked argument (the ones `pack(...,
        consume=True)` deletes)."""
        return [i for i, (_, row) in enumerate(self._where) if row is not None]

    def pack(self, leaves: list[jax.Array], consume: bool = False) -> list[jax.Array]:
        """The launch's parameter arguments from leaves laid out as the ones this was built on
        (the model's weights, or new weights of the same model: the same programs take them).
        Holds none of them: the programs keep this object, and new weights must free the old.
        `consume`: each stacked leaf is deleted as soon as its stack is built (the caller must
        not read them again)."""
        if len(leaves) != self.num_leaves:
            raise ValueError(f"expected {self.num_leaves} parameter leaves, got {len(leaves)}")
        args = []
        for arg in self._args:
            if isinstance(arg, int):
                args.append(leaves[arg])
                continue
            rows = [leaves[j] for j in arg[1]]
            args.append(_stack(rows, arg[0]))
            if consume:
                for x in rows:
                    if not x.is_deleted():  # one array may be two leaves
                        x.delete()
        if self._matrix_stacks:
            args.append(
                jax.device_put(jnp.arange(self._num_rows, dtype=jnp.int32), self._rows_sharding)
            )
        return args

    def leaf(self, args: list[jax.Array], i: int) -> jax.Array:
        """Leaf `i` as an array from `pack`'s arguments (a copy of its row if stacked)."""
        a, row = self._where[i]
        return args[a] if row is None else _row_taker(self._args[a][0])(args[a], row)

    def unpack(self, args: list[jax.Array], consume: bool = False) -> list[jax.Array]:
        """The leaves as arrays again (each on its own sharding), from `pack`'s arguments.
        `consume`: the stacks are deleted once their rows are out."""
        self._check(args)
        leaves = [self.leaf(args, i) for i in range(self.num_leaves)]
        if consume:
            for a, arg in enumerate(self._args):
                if not isinstance(arg, int):
                    args[a].delete()
        return leaves

    @property
    def num_stacked(self) -> int:
        """Leaves that travel inside a stacked argument."""
        return len(self.stacked_leaves)

    def unflatten(self, args):
        """The parameter tree from the launch's parameter arguments (traced or concrete)."""
        self._check(args)
        rows = args[-1] if self._matrix_stacks else None

        def leaf(a: int, row: int | None):
            if row is None:
                return args[a]
            if a in self._matrix_stacks:  # at a runtime index: one HLO for every layer
                return jax.lax.dynamic_index_in_dim(args[a], rows[row], 0, keepdims=False)
            return args[a][row]

        return jax.tree.unflatten(self.treedef, [leaf(a, row) for a, row in self._where])

    def _check(self, args) -> None:
        if len(args) != self.num_args:
            raise ValueError(f"expected {self.num_args} parameter arguments, got {len(args)}")


def _stack(leaves: list[jax.Array], key: tuple) -> jax.Array:
    """The leaves as rows of one array on their own sharding, the new axis whole."""
    _, _, mesh, spec = key
    return _stacker(NamedSharding(mesh, PartitionSpec(None, *spec)))(*leaves)


@functools.cache
def _stacker(sharding: NamedSharding):
    # One jit per sharding, kept: a fresh lambda each call was a cache miss, so every
    # update_weights (which packs the state again) lowered and compiled the stacks anew.
    return jax.jit(lambda *xs: jnp.stack(xs), out_shardings=sharding)


@functools.cache
def _row_taker(key: tuple):
    """`take(stack, row)`: one row of a stack as an array of its own, on the leaves' sharding
    (the row an argument: one program per stack shape)."""
    _, _, mesh, spec = key
    take = jax.jit(
        lambda stack, row: jax.lax.dynamic_index_in_dim(stack, row, 0, keepdims=False),
        out_shardings=NamedSharding(mesh, PartitionSpec(*spec)),
    )
    return lambda stack, row: take(stack, jnp.int32(row))
