"""Architecture of a Llama-family model, read from a Hugging Face `config.json`-style dict.

Covers Llama 2/3 (incl. `rope_scaling` of type llama3), Mistral, Qwen2/2.5 (qkv bias) and SmolLM2;
GQA and MQA; tied or untied embeddings. Presets in `configs/models/*.yaml` use the same keys.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from nori_jax.yaml_file import read_yaml

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
PRESET_DIR = Path(__file__).resolve().parent.parent / "configs" / "models"


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3's frequency-dependent rope scaling; other types are rejected at parse time."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    rope_scaling: RopeScaling | None = None
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type={self.model_type!r} is not one of {SUPPORTED_MODEL_TYPES}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )

    @property
    def position_limit(self) -> int:
        """The longest sequence this engine runs the model on: its positions, and inside its
        sliding window where it has one (attention here has no sliding window)."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        model_type = cfg.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type={model_type!r} is not one of {SUPPORTED_MODEL_TYPES}")
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden // num_heads
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(
            int(e) for e in (eos if isinstance(eos, list) else [eos] if eos is not None else [])
        )
        # transformers >= 5 writes `rope_parameters` (theta included); older configs use
        # `rope_theta` + `rope_scaling`.
        rope_params = cfg.get("rope_parameters") or {}
        rope_theta = rope_params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        rope_scaling = rope_params if rope_params else cfg.get("rope_scaling")
        sliding = cfg.get("sliding_window")
        if model_type == "qwen2" and not cfg.get("use_sliding_window", False):
            sliding = None
        return cls(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            rope_scaling=_parse_rope_scaling(rope_scaling),
            sliding_window=int(sliding) if sliding else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


def _parse_rope_scaling(rs: dict[str, Any] | None) -> RopeScaling | None:
    if not rs:
        return None
    rope_type = rs.get("rope_type", rs.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type != "llama3":
        raise ValueError(f"rope_scaling type {rope_type!r} is not supported (only 'llama3')")
    return RopeScaling(
        factor=float(rs["factor"]),
        low_freq_factor=float(rs["low_freq_factor"]),
        high_freq_factor=float(rs["high_freq_factor"]),
        original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
    )


def list_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def load_preset(name: str) -> dict[str, Any]:
    """The HF-style config dict of a shape preset in configs/models/."""
    path = PRESET_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"unknown model preset {name!r}; presets: {list_presets()}")
    return read_yaml(path)
