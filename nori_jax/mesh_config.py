"""How an engine spreads over devices: JAX-free, so configs and the CLI load without JAX
(`executor/mesh.py` builds the meshes themselves).

Three numbers say it, as vLLM's and SGLang's users know them:

- `model` (`--tensor-parallel-size`): the devices of one engine replica; heads and MLP columns
  split over its mesh axis `model`.
- `data` (`--data-parallel-size`): colocated replicas, each on its own `model` devices, behind one
  front end that routes requests among them.
- `prefill` / `decode` (`--prefill-replicas` / `--decode-replicas`): disaggregation. Replicas
  that only prefill and replicas that only decode, each of `model` devices; a request's KV pages
  move from the first kind to the second after its prefill. Both zero: colocated.

One more field tunes how the front end routes among `data` replicas
(`prefix_affinity_max_imbalance_tokens`, core/replica_router.py); it places nothing on devices.

Replica i holds devices [i * model, (i + 1) * model); prefill replicas come before decode ones.
Presets live in configs/mesh/ (`--mesh tp4`, `LLM(mesh="pd-1-1")`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from nori_jax.config_field import check_types, option
from nori_jax.yaml_file import read_yaml
from pallas_kernels.page_constants import stored_kv_heads

if TYPE_CHECKING:
    from nori_jax.model_config import ModelConfig

# The axes of one replica's mesh. `data` stays a (size-1) axis inside a replica so that sharding
# specs can name it; replicas themselves are separate meshes.
AXES = ("data", "model")
MESH_PRESET_DIR = Path(__file__).resolve().parent.parent / "configs" / "mesh"
Role = Literal["colocated", "prefill", "decode"]
LAYOUT_FIELDS = ("model", "data", "prefill", "decode")  # the fields that decide the devices


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    model: int = option(
        1,
        help="devices per engine replica (tensor parallelism: heads and MLP split over them)",
        flags=("--tensor-parallel-size", "--tp"),
    )
    data: int = option(
        1,
        help="colocated engine replicas on disjoint devices behind one front end (data parallel)",
        flags=("--data-parallel-size", "--dp"),
    )
    prefill: int = option(
        0,
        help="disaggregated: replicas that only prefill (0 with --decode-replicas 0: colocated)",
        flags=("--prefill-replicas",),
    )
    decode: int = option(
        0,
        help="disaggregated: replicas that only decode, fed KV pages by the prefill replicas",
        flags=("--decode-replicas",),
    )
    # Beside `data` because only data-parallel replicas are routed. The router's other settings
    # (how many pages key its table, the table's size) stay internal: they size its memory.
    prefix_affinity_max_imbalance_tokens: int = option(
        4096,
        help="data parallel: a request goes to the replica that last served its prompt's first "
        "pages while that replica owes at most this many tokens (prompt + max_tokens of its "
        "requests in flight) more than the least loaded one, else to the least loaded "
        "(0: the prefix only breaks ties)",
    )

    def __post_init__(self) -> None:
        check_types(self, prefix="mesh ")
        for name in ("model", "data"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"mesh {name}={value!r} must be an integer >= 1")
        for name in ("prefill", "decode", "prefix_affinity_max_imbalance_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"mesh {name}={value!r} must be an integer >= 0")
        if (self.prefill == 0) != (self.decode == 0):
            raise ValueError(
                f"mesh prefill={self.prefill} decode={self.decode}: disaggregation needs at "
                "least one replica of each kind"
            )
        if self.disaggregated and self.data != 1:
            raise ValueError(
                f"mesh data={self.data} with prefill={self.prefill} decode={self.decode}: "
                "disaggregated replicas are counted by prefill and decode, leave data at 1"
            )

    @property
    def disaggregated(self) -> bool:
        return self.prefill > 0

    @property
    def num_replicas(self) -> int:
        return self.prefill + self.decode if self.disaggregated else self.data

    @property
    def num_devices(self) -> int:
        return self.num_replicas * self.model

    def roles(self) -> list[Role]:
        """Each replica's role, in device order."""
        if self.disaggregated:
            return ["prefill"] * self.prefill + ["decode"] * self.decode
        return ["colocated"] * self.data

    def device_indices(self, replica: int) -> range:
        """The indices (into jax.devices()) of replica `replica`'s devices."""
        if not 0 <= replica < self.num_replicas:
            raise ValueError(f"replica={replica} must be in [0, {self.num_replicas})")
        return range(replica * self.model, (replica + 1) * self.model)

    def replica(self) -> MeshConfig:
        """The mesh of one replica on its own (same tensor parallelism, one replica)."""
        return MeshConfig(model=self.model)

    def describe(self) -> str:
        if self.disaggregated:
            return f"{self.prefill} prefill + {self.decode} decode replicas x tp{self.model}"
        return f"{self.data} replica{'s' if self.data > 1 else ''} x tp{self.model}"

    def fields_text(self) -> str:
        """The fields that place replicas on devices, as given: `model=4, data=2, ...` (for
        errors about devices, where the routing bound would only be noise)."""
        return ", ".join(f"{name}={getattr(self, name)}" for name in LAYOUT_FIELDS)

    @classmethod
    def from_yaml(cls, path: str | Path) -> MeshConfig:
        values = read_yaml(path) or {}
        if not isinstance(values, dict):
            raise ValueError(f"mesh config {str(path)!r} must be a mapping of MeshConfig fields")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"mesh config {str(path)!r}: unknown keys {unknown}")
        return cls(**values)

    @classmethod
    def from_name(cls, name_or_path: str | Path) -> MeshConfig:
        """A preset: a YAML path, or a name in configs/mesh/ (`tp4`, `dp2-tp4`, `pd-1-1`)."""
        p = Path(name_or_path)
        if not p.is_file():
            p = MESH_PRESET_DIR / f"{name_or_path}.yaml"
        if not p.is_file():
            raise ValueError(
                f"mesh {str(name_or_path)!r} not found (neither a file nor one of "
                f"{mesh_preset_names()})"
            )
        return cls.from_yaml(p)

    def check_model(self, cfg: ModelConfig) -> None:
        """Tensor parallelism splits q heads, MLP columns and the vocabulary evenly; kv heads
        are split too, or, when there are fewer kv heads than devices, each is replicated on
        model / num_kv_heads devices (so the number of kv heads must divide the devices)."""
        tp = self.model
        for name, n in (
            ("num_heads", cfg.num_heads),
            ("intermediate_size", cfg.intermediate_size),
            ("vocab_size", cfg.vocab_size),
        ):
            if n % tp:
                raise ValueError(
                    f"tensor parallel size (mesh model={tp}) does not divide the model's {name}={n}"
                )
        if cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
            raise ValueError(
                f"tensor parallel size (mesh model={tp}) and the model's "
                f"num_kv_heads={cfg.num_kv_heads}: one must divide the other"
            )

    def kv_heads(self, cfg: ModelConfig) -> int:
        """KV heads each layer's pages hold across one replica's devices (replicas counted)."""
        return stored_kv_heads(cfg.num_kv_heads, self.model)


def mesh_preset_names() -> list[str]:
    return sorted(p.stem for p in MESH_PRESET_DIR.glob("*.yaml"))
