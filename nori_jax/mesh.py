"""Device mesh with axes (`data`, `model`): one device by default, tensor parallel over `model`."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import numpy as np
import yaml
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nori_jax.model_config import ModelConfig

AXES = ("data", "model")
MESH_PRESET_DIR = Path(__file__).resolve().parent.parent / "configs" / "mesh"


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    data: int = 1
    model: int = 1

    def __post_init__(self) -> None:
        if self.data < 1 or self.model < 1:
            raise ValueError(f"mesh sizes must be >= 1, got data={self.data} model={self.model}")

    @property
    def num_devices(self) -> int:
        return self.data * self.model

    @classmethod
    def from_yaml(cls, path: str | Path) -> MeshConfig:
        return cls(**yaml.safe_load(Path(path).read_text()))

    def check_model(self, cfg: ModelConfig) -> None:
        """Tensor parallelism splits heads and MLP columns: each must divide evenly."""
        tp = self.model
        for name, n in (
            ("num_heads", cfg.num_heads),
            ("num_kv_heads", cfg.num_kv_heads),
            ("intermediate_size", cfg.intermediate_size),
        ):
            if n % tp:
                raise ValueError(f"mesh model={tp} does not divide {name}={n}")


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
