"""Parameters stacked by kind (executor/param_stack.py): few buffers per launch, the same model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from nori_jax.executor.mesh import make_mesh
from nori_jax.executor.param_stack import stack_leaves, unstacked_copy
from nori_jax.mesh_config import MeshConfig
from nori_jax.weights.loader import load_model


def test_alike_leaves_share_a_stack_and_unstack_to_themselves():
    rng = np.random.default_rng(0)
    values = [rng.standard_normal(s).astype(np.float32) for s in [(4, 8), (8,), (4, 8), (4, 8)]]
    values.append(rng.integers(0, 9, (4, 8)).astype(np.int8))  # same shape, other dtype
    leaves = [jnp.asarray(v) for v in values]
    stacks, layout = stack_leaves(leaves)
    assert [s.shape for s in stacks] == [(3, 4, 8), (8,), (4, 8)]
    assert layout.slots == ((0, 0), (1, None), (0, 1), (0, 2), (2, None))
    # The stacked originals are handed over; the lone ones are the stacks themselves.
    assert [x.is_deleted() for x in leaves] == [True, False, True, True, False]
    inside_jit = jax.jit(layout.unstack)(stacks)
    for got, want in zip(inside_jit, values, strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)
    for got, want in zip(unstacked_copy(stacks, layout), values, strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)


def test_a_stack_keeps_its_rows_sharding():
    """(Split over several devices: tests/tp_layouts.py reads an engine's state on 8.)"""
    mesh = make_mesh(MeshConfig())
    spec = NamedSharding(mesh, PartitionSpec(None, "model"))
    leaves = [jax.device_put(np.full((4, 8), i, np.float32), spec) for i in range(3)]
    stacks, layout = stack_leaves(leaves)
    assert stacks[0].sharding.spec == PartitionSpec(None, None, "model")
    rows = unstacked_copy(stacks, layout)
    assert all(r.sharding.spec == spec.spec for r in rows)
    assert [float(r[0, 0]) for r in rows] == [0.0, 1.0, 2.0]


@pytest.fixture(scope="module")
def loaded():
    return load_model(
        "tiny-llama", load_format="dummy", dtype="float32", mesh=make_mesh(MeshConfig())
    )


def test_the_model_passes_one_buffer_per_weight_kind(loaded):
    before = jax.tree.map(np.asarray, loaded.state)
    num_leaves = len(jax.tree.leaves(before))
    weight_bytes = loaded.weight_bytes
    stacks, layout, _ = loaded.stacked_parameters()
    layers = loaded.config.num_layers
    # Per layer: two norms and seven linear kernels, some alike in shape: at most 9 stacks of
    # `layers` rows, plus the embedding and the final norm.
    assert layout.num_leaves == num_leaves >= 9 * layers
    assert len(stacks) <= 9 + 2
    assert max(s.shape[0] for s in stacks) >= layers
    assert loaded.stacked_parameters()[0] is stacks  # stacked once
    assert loaded.weight_bytes == weight_bytes
    # The state is still there to inspect, value for value.
    after = jax.tree.map(np.asarray, loaded.state)
    jax.tree.map(np.testing.assert_array_equal, after, before)
