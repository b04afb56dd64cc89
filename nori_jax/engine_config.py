"""Everything that configures an engine, in one frozen dataclass: YAML fills it, CLIs override."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from nori_jax.mesh_config import MeshConfig
from nori_jax.quantization.scheme import QUANTIZATION_MODES

ENGINE_PRESET_DIR = Path(__file__).resolve().parent.parent / "configs" / "engine"
ATTENTION_BACKENDS = ("auto", "reference", "pallas")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    model: str | None = (
        None  # HF dir, .gguf file, or preset (with load_format="dummy"); None: default
    )
    tokenizer: str | None = None  # HF dir with tokenizer.json, overriding the model's own
    dtype: str = "auto"
    # Weights of the decoder's linear layers: None (the dtype), "fp8", "int8" or "int4" (vLLM's
    # field; layouts in quantization/scheme.py).
    quantization: str | None = None
    load_format: str = "auto"
    seed: int = 0
    param_cache: bool = (
        True  # keep converted parameters in an orbax cache (see weights/checkpoint_cache.py)
    )
    # KV cache
    page_size: int = 64
    num_pages: int | None = None  # None: sized from gpu_memory_utilization
    gpu_memory_utilization: float = 0.9  # share of device memory for weights + KV pages
    cpu_kv_cache_gib: float = 1.0  # KV budget on a CPU backend, where memory_stats is absent
    # Batching
    max_model_len: int | None = None  # None: min(model's max_position_embeddings, 8192)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    enable_prefix_caching: bool = True
    long_prefill_threshold: int | None = None
    long_prefill_token_share: float = 0.25
    kv_headroom: float = 0.1
    max_num_waiting: int | None = None
    # Execution
    attention_backend: str = "auto"
    # Plan step N+1 while the device runs step N (outputs trail the device by one step).
    async_scheduling: bool = True
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    compilation_cache_dir: str | None = None  # None: $NORI_JAX_CACHE_DIR or ~/.cache/nori_jax/xla

    def __post_init__(self) -> None:
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size={self.page_size} must be a power of two")
        if self.num_pages is not None and self.num_pages < 2:
            raise ValueError(f"num_pages={self.num_pages} must be >= 2 (page 0 is reserved)")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]"
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend={self.attention_backend!r} must be one of {ATTENTION_BACKENDS}"
            )
        if self.quantization is not None and self.quantization not in QUANTIZATION_MODES:
            raise ValueError(
                f"quantization={self.quantization!r} must be None or one of {QUANTIZATION_MODES}"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len={self.max_model_len} must be >= 2")

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> EngineConfig:
        """Load a preset (a path or a name in configs/engine/), then apply non-None overrides."""
        p = Path(path)
        if not p.is_file():
            p = ENGINE_PRESET_DIR / f"{path}.yaml"
        if not p.is_file():
            raise ValueError(f"engine config {str(path)!r} not found (nor in {ENGINE_PRESET_DIR})")
        values = yaml.safe_load(p.read_text()) or {}
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls.from_dict(values)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> EngineConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError(f"unknown engine config keys {unknown}")
        values = dict(values)
        if isinstance(values.get("mesh"), dict):
            values["mesh"] = MeshConfig(**values["mesh"])
        return cls(**values)
