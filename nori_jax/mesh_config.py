"""The shape of the device mesh, axes (`data`, `model`): JAX-free, so configs and the CLI load
without JAX (`executor/mesh.py` builds the mesh itself)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from nori_jax.config_field import option

if TYPE_CHECKING:
    from nori_jax.model_config import ModelConfig

AXES = ("data", "model")
MESH_PRESET_DIR = Path(__file__).resolve().parent.parent / "configs" / "mesh"


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    data: int = option(
        1,
        help="devices on the mesh axis `data` (parameters and KV pages are replicated over it)",
        flags=("--mesh-data",),
    )
    model: int = option(
        1,
        help="devices on the mesh axis `model` (tensor parallelism: heads and MLP split over them)",
        flags=("--tensor-parallel-size", "--tp"),
    )

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
