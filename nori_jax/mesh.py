"""Device mesh with axes (`data`, `model`): one device by default, tensor parallel over `model`."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nori_jax.mesh_config import MeshConfig

AXES = ("data", "model")
__all__ = ["AXES", "MeshConfig", "make_mesh", "replicated"]


def make_mesh(config: MeshConfig) -> Mesh:
    devices = jax.devices()
    if config.num_devices > len(devices):
        raise ValueError(
            f"mesh data={config.data} x model={config.model} needs {config.num_devices} devices; "
            f"{len(devices)} available"
        )
    grid = np.asarray(devices[: config.num_devices]).reshape(config.data, config.model)
    return Mesh(grid, AXES)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())
