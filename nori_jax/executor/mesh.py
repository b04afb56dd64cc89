"""The device mesh of one engine replica, axes (`data`, `model`): its `model` devices, tensor
parallel over `model` (mesh_config.py says which devices each replica holds)."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nori_jax.mesh_config import AXES, MeshConfig


def make_mesh(config: MeshConfig, replica: int = 0, devices: list | None = None) -> Mesh:
    """Replica `replica`'s mesh, shape (1, config.model), over `devices` (default jax.devices())."""
    devices = jax.devices() if devices is None else devices
    if config.num_devices > len(devices):
        hint = (
            " (a CPU mesh for experiments: XLA_FLAGS=--xla_force_host_platform_device_count="
            f"{config.num_devices}, set before JAX starts)"
            if devices[0].platform == "cpu"
            else ""
        )
        raise ValueError(
            f"mesh {config.describe()} ({config.fields_text()}) needs {config.num_devices} "
            f"devices; {len(devices)} available ({devices[0].platform}){hint}"
        )
    picked = [devices[i] for i in config.device_indices(replica)]
    return Mesh(np.asarray(picked).reshape(1, config.model), AXES)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())
