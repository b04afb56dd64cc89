"""The device mesh as configuration: axis sizes (`data`, `model`), checked against a model.

JAX-free, so configs can be built and validated in processes that never touch a device; the mesh
itself is made by `nori_jax.executor.mesh.make_mesh`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

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
