"""PackedParams: same-shaped vectors travel as rows of one argument, everything else as it is, and
the program gets back exactly the leaves it was given."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nori_jax.executor.param_packing import PackedParams


@pytest.fixture(scope="module")
def mesh():
    return Mesh(np.array(jax.devices()[:1]), ("model",))


def _on(mesh, x, *spec):
    return jax.device_put(x, NamedSharding(mesh, PartitionSpec(*spec)))


def test_vectors_of_one_shape_dtype_and_sharding_share_an_argument(mesh):
    norms = [_on(mesh, jnp.full((6,), i, jnp.bfloat16), None) for i in range(3)]
    weight = _on(mesh, jnp.arange(12.0).reshape(3, 4), None, None)
    bias = _on(mesh, jnp.arange(6, dtype=jnp.float32), "model")  # another dtype and spec
    lone = _on(mesh, jnp.ones((5,), jnp.bfloat16), None)  # another shape, alone
    tree = {"a": norms[0], "b": [weight, norms[1]], "c": bias, "d": norms[2], "e": lone}
    leaves, treedef = jax.tree.flatten(tree)
    packed = PackedParams(leaves, treedef)
    args = packed.pack(leaves)

    assert len(args) == packed.num_args == len(leaves) - 2 and packed.num_stacked == 3
    stacked = [a for a in args if a.shape == (3, 6)]
    assert len(stacked) == 1
    assert stacked[0].sharding.spec == PartitionSpec(None, None)
    np.testing.assert_array_equal(np.asarray(stacked[0], np.float32)[:, 0], [0, 1, 2])

    back = jax.jit(lambda args: packed.unflatten(args))(args)
    assert jax.tree.structure(back) == treedef
    for got, want in zip(jax.tree.leaves(back), leaves, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_unflatten_names_a_wrong_argument_count(mesh):
    leaves = [_on(mesh, jnp.zeros((4,)), None) for _ in range(2)]
    packed = PackedParams(leaves, jax.tree.structure([0, 0]))
    with pytest.raises(ValueError, match="expected 1 parameter arguments, got 2"):
        packed.unflatten(leaves)


def _layers(mesh, n=3):
    """n layers of two matrices of different shapes and a norm vector, plus a lone embedding."""
    key = jax.random.key(0)
    layers = [
        {
            "w1": _on(mesh, jax.random.normal(jax.random.fold_in(key, i), (4, 6)), None, "model"),
            "w2": _on(mesh, jax.random.normal(jax.random.fold_in(key, 10 + i), (6, 4)), None, None),
            "norm": _on(mesh, jnp.full((4,), float(i)), None),
        }
        for i in range(n)
    ]
    return {"embed": _on(mesh, jnp.arange(20.0).reshape(5, 4), None, None), "layers": layers}


def test_matrices_stack_by_kind_and_come_back_exactly(mesh):
    leaves, treedef = jax.tree.flatten(_layers(mesh))
    want = [np.asarray(x) for x in leaves]
    packed = PackedParams(leaves, treedef, stack_matrices=True)
    args = packed.pack(leaves)
    # embed alone, w1, w2 and norm stacks, and the rows' index
    assert packed.num_args == len(args) == 5 and packed.num_stacked == 9
    w1 = next(a for a in args if a.shape == (3, 4, 6))
    assert w1.sharding.spec == PartitionSpec(None, None, "model")
    np.testing.assert_array_equal(np.asarray(args[-1]), [0, 1, 2])

    program = jax.jit(lambda args: packed.unflatten(args))
    for got, x in zip(jax.tree.leaves(program(args)), want, strict=True):
        np.testing.assert_array_equal(np.asarray(got), x)
    # Each layer's matrix is taken at an index the program reads, not a constant it folds.
    assert "dynamic-slice" in program.lower(args).compile().as_text()
    for i, x in enumerate(want):
        np.testing.assert_array_equal(np.asarray(packed.leaf(args, i)), x)
    for got, x in zip(packed.unpack(list(args)), want, strict=True):
        np.testing.assert_array_equal(np.asarray(got), x)
    rows = packed.unpack(list(args), consume=True)
    assert all(a.is_deleted() for a in args if a.ndim > 2)
    assert rows[packed.stacked_leaves[0]].sharding == leaves[packed.stacked_leaves[0]].sharding


def test_pack_consuming_deletes_each_stacked_leaf(mesh):
    leaves, treedef = jax.tree.flatten(_layers(mesh))
    packed = PackedParams(leaves, treedef, stack_matrices=True)
    packed.pack(leaves, consume=True)
    assert [i for i, x in enumerate(leaves) if x.is_deleted()] == packed.stacked_leaves
    assert not leaves[0].is_deleted()  # the embedding, alone of its shape, is the argument
