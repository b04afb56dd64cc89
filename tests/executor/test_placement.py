"""`ReplicatedPut`: the step buffer's transfer gives what `jax.device_put` gives, on one device and
replicated over a mesh, and refuses an array of another shape or dtype (whose bytes the runtime
would otherwise take as they are)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from cpu_devices import cpu_devices_env
from jax.sharding import SingleDeviceSharding

from nori_jax.executor.placement import ReplicatedPut


def test_same_array_as_device_put_on_one_device(monkeypatch):
    sharding = SingleDeviceSharding(jax.devices()[0])
    put = ReplicatedPut((300,), np.int32, sharding)
    # the runtime's transfer itself, not jax.device_put's path (the point of the class)
    monkeypatch.setattr(jax, "device_put", lambda *a, **k: pytest.fail("went through device_put"))
    for seed in range(3):  # call after call, each with its own values
        value = np.random.default_rng(seed).integers(-(2**31), 2**31 - 1, 300, dtype=np.int32)
        got = put(value)
        assert got.sharding == sharding and got.dtype == np.int32 and got.shape == (300,)
        np.testing.assert_array_equal(np.asarray(got), value)
        np.testing.assert_array_equal(np.asarray(got + 1), value + 1)  # a program can use it


@pytest.mark.parametrize(
    "value", [np.zeros(299, np.int32), np.zeros(300, np.float32), np.zeros((2, 150), np.int32)]
)
def test_another_shape_or_dtype_is_refused(value):
    put = ReplicatedPut((300,), np.int32, SingleDeviceSharding(jax.devices()[0]))
    with pytest.raises(ValueError, match=r"expected int32\[300\]"):
        put(value)


MESH = textwrap.dedent(
    """
    import jax, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    from nori_jax.executor.placement import ReplicatedPut
    mesh = Mesh(np.array(jax.devices()), ("model",))
    sharding = NamedSharding(mesh, PartitionSpec())
    put = ReplicatedPut((64,), np.int32, sharding)
    value = np.arange(64, dtype=np.int32)
    got = put(value)
    assert got.sharding == sharding, got.sharding
    assert len(got.addressable_shards) == 2
    for shard in got.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), value)
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda x: x * 2)(got)), value * 2)
    print("ok")
    """
)


def test_replicated_over_a_mesh_of_two_devices():
    env = cpu_devices_env(2)
    proc = subprocess.run(
        [sys.executable, "-c", MESH], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
