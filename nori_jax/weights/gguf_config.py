"""A Hugging Face `config.json` dict rebuilt from a GGUF file's llama.cpp metadata.

llama.cpp keys live under the architecture's prefix (`llama.embedding_length`, ...). Sizes the
metadata may leave out (head_dim, vocab size) are checked against the tensor shapes.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from nori_jax.weights.gguf_file import GGUFFile

# GGUF `general.architecture` -> (HF model_type, HF architectures entry). Mistral GGUFs say "llama".
SUPPORTED_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
}

_REQUIRED = object()

# Llama 3.x writes its rope scaling as a `rope_freqs` tensor; these are the values every Llama 3.x
# config uses, tried before fitting them from the tensor (only the two wavelength ratios matter).
_LLAMA3_DEFAULTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original": 8192}


def hf_config_from_gguf(file: GGUFFile, rope_freqs: np.ndarray | None = None) -> dict[str, Any]:
    """The HF config dict for `file`; `rope_freqs`: its `rope_freqs.weight` tensor, if any."""
    md = file.metadata
    path = str(file.path)
    arch = md.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{path!r}: architecture {arch!r} is not supported; supported: "
            f"{sorted(SUPPORTED_ARCHITECTURES)}"
        )
    model_type, hf_class = SUPPORTED_ARCHITECTURES[arch]

    def key(name: str, default: Any = _REQUIRED) -> Any:
        full = f"{arch}.{name}"
        if full in md:
            return _uniform(md[full], full, path)
        if default is _REQUIRED:
            raise ValueError(f"{path!r}: metadata key {full!r} is missing")
        return default

    hidden = key("embedding_length")
    n_heads = key("attention.head_count")
    n_kv_heads = key("attention.head_count_kv", n_heads)
    head_dim = key("attention.key_length", hidden // n_heads)
    tensors = file.tensors
    q_rows = tensors["blk.0.attn_q.weight"].shape[0] if "blk.0.attn_q.weight" in tensors else None
    if q_rows is not None and q_rows != n_heads * head_dim:
        raise ValueError(
            f"{path!r}: tensor 'blk.0.attn_q.weight' has {q_rows} rows but the metadata says "
            f"{n_heads} heads of {head_dim}; the file is inconsistent"
        )
    if key("attention.value_length", head_dim) != head_dim:
        raise ValueError(f"{path!r}: value heads differ from key heads; not a llama-family model")
    rope_dim = key("rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise ValueError(f"{path!r}: partial rotary ({rope_dim=} of {head_dim=}) is not supported")

    vocab_size = _vocab_size(file, key)
    rope_theta = _f32(key("rope.freq_base", 10000.0))
    config: dict[str, Any] = {
        "architectures": [hf_class],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _f32(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": rope_theta,
        "rope_scaling": _rope_scaling(key, path, rope_freqs, rope_theta, head_dim),
        "max_position_embeddings": key("context_length"),
        "vocab_size": vocab_size,
        # llama.cpp writes `output.weight` only when the LM head is not the embedding matrix
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "mlp_bias": False,
        "bos_token_id": md.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": md.get("tokenizer.ggml.eos_token_id"),
    }
    if "tokenizer.ggml.padding_token_id" in md:
        config["pad_token_id"] = md["tokenizer.ggml.padding_token_id"]
    return config


def _vocab_size(file: GGUFFile, key: Any) -> int:
    embed = file.tensors.get("token_embd.weight")
    if embed is None:
        raise ValueError(f"{str(file.path)!r}: tensor 'token_embd.weight' is missing")
    n_tokens = len(file.metadata.get("tokenizer.ggml.tokens", ()))
    stated = key("vocab_size", n_tokens or embed.shape[0])
    if stated != embed.shape[0] or (n_tokens and n_tokens != embed.shape[0]):
        raise ValueError(
            f"{str(file.path)!r}: tensor 'token_embd.weight' has {embed.shape[0]} rows but the "
            f"vocabulary has {n_tokens} tokens ({stated} stated); the file is inconsistent"
        )
    return embed.shape[0]


def _rope_scaling(
    key: Any, path: str, rope_freqs: np.ndarray | None, theta: float, head_dim: int
) -> dict[str, Any] | None:
    kind = key("rope.scaling.type", None)
    factor = key("rope.scaling.factor", None) or key("rope.scale_linear", None)
    if rope_freqs is not None:
        if kind not in (None, "none"):
            raise ValueError(f"{path!r}: both rope_freqs and rope.scaling.type={kind!r} are set")
        return _llama3_rope_scaling(rope_freqs, theta, head_dim, path)
    if kind is None and factor is not None:  # older files: `rope.scale_linear` only
        kind = "linear"
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": _f32(factor)}
    if kind == "yarn":
        scaling = {
            "rope_type": "yarn",
            "factor": _f32(factor),
            "original_max_position_embeddings": key("rope.scaling.original_context_length"),
        }
        for gguf_name, hf_name in (
            ("yarn_beta_fast", "beta_fast"),
            ("yarn_beta_slow", "beta_slow"),
        ):
            if (value := key(f"rope.scaling.{gguf_name}", None)) is not None:
                scaling[hf_name] = _f32(value)
        return scaling
    raise ValueError(f"{path!r}: rope.scaling.type={kind!r} is not supported (none, linear, yarn)")


def _llama3_rope_scaling(
    freqs: np.ndarray, theta: float, head_dim: int, path: str
) -> dict[str, Any] | None:
    """HF's llama3 rope parameters that reproduce llama.cpp's per-frequency divisors `freqs`.

    llama.cpp stores 1 for high frequencies, `factor` for low ones and a smooth blend in between.
    HF's blend depends on original_max_position_embeddings only through the two wavelength
    thresholds, so that value is fixed at Llama 3's 8192 and the two factors solved for.
    """
    freqs = np.asarray(freqs, dtype=np.float64).reshape(-1)
    if freqs.shape != (head_dim // 2,):
        raise ValueError(
            f"{path!r}: tensor 'rope_freqs.weight' has {freqs.shape=}, expected {head_dim // 2}"
        )
    factor = float(freqs.max())
    if np.allclose(freqs, 1.0):
        return None
    inv_wavelen = theta ** (-np.arange(0, head_dim, 2) / head_dim) / (2 * math.pi)
    candidates = [_LLAMA3_DEFAULTS]
    middle = (freqs > 1 + 1e-6) & (freqs < factor * (1 - 1e-6))
    if middle.sum() >= 2:  # smooth = original * inv_wavelen / (high - low) - low / (high - low)
        smooth = (1 / freqs[middle] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(inv_wavelen[middle], smooth, 1)
        span = _LLAMA3_DEFAULTS["original"] / slope
        low = -intercept * span
        candidates.append(
            {"low_freq_factor": low, "high_freq_factor": low + span, "original": 8192}
        )
    for c in candidates:
        if np.allclose(_llama3_divisors(inv_wavelen, factor, **c), freqs, rtol=1e-4, atol=0):
            return {
                "rope_type": "llama3",
                "factor": _f32(factor),
                "low_freq_factor": round(float(c["low_freq_factor"]), 6),
                "high_freq_factor": round(float(c["high_freq_factor"]), 6),
                "original_max_position_embeddings": c["original"],
            }
    raise ValueError(f"{path!r}: tensor 'rope_freqs.weight' does not match llama3 rope scaling")


def _llama3_divisors(
    inv_wavelen: np.ndarray,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original: int,
) -> np.ndarray:
    smooth = (original * inv_wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smooth = np.clip(smooth, 0.0, 1.0)  # 0: long wavelengths, divided by factor; 1: kept
    return 1 / ((1 - smooth) / factor + smooth)


def _uniform(value: Any, name: str, path: str) -> Any:
    """Per-layer arrays (some files write head counts per layer) must agree across layers."""
    if isinstance(value, list):
        if not value or any(v != value[0] for v in value):
            raise ValueError(f"{path!r}: {name}={value!r:.80} varies per layer; not supported")
        return value[0]
    return value


def _f32(value: float) -> float:
    """llama.cpp stores these as float32: give the shortest decimal that rounds to it (1e-05, not
    9.999999747378752e-06), i.e. the value the original config.json most likely held."""
    return float(str(np.float32(value)))
