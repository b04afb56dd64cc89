"""GGUF checkpoints (llama.cpp's format) as Hugging Face names, HF config and a `Tokenizer`.

    ckpt = load_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")
    ckpt.hf_config["num_hidden_layers"]  # HF config.json keys
    for name, array in ckpt.tensors():   # "model.layers.0.self_attn.q_proj.weight", float32
        ...

`load_gguf` reads only the header; each tensor is dequantized when `tensors()` reaches it, so peak
memory is one float32 tensor beyond what the caller keeps. Everything that can be checked without
the data is checked up front: architecture, hyper-parameters, tensor names and shapes, quantization
types, file length.

llama.cpp's converter reorders the rows of Q and K for its rotary convention (pairs (i, i + d/2)
become adjacent (2i, 2i + 1)); for `llama` files that is undone here so the weights use HF's
rotate-half rotary. Qwen2 files are written without the reorder (llama.cpp runs Qwen2 as NeoX).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGMLQuantizationType

from nori_jax.tokenizer import Tokenizer
from nori_jax.weights.gguf_blocks import Blocks, decode_blocks
from nori_jax.weights.gguf_config import hf_config_from_gguf
from nori_jax.weights.gguf_file import GGUFFile, GGUFTensorInfo, read_gguf_file
from nori_jax.weights.gguf_tensors import check_supported, dequantize
from nori_jax.weights.gguf_tokenizer import tokenizer_from_gguf

_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER = re.compile(r"^blk\.(\d+)\.(.+)$")

# Bump when the tensors or config this loader produces from the same file change, so caches of
# converted parameters (keyed on the file) know to convert again.
CONVERSION_VERSION = 1
_ROPE_FREQS = "rope_freqs.weight"  # llama3 rope scaling, folded into hf_config["rope_scaling"]


@dataclasses.dataclass(frozen=True, eq=False)  # identity: holds a memmap
class GGUFCheckpoint:
    path: Path
    hf_config: dict[str, Any]
    tokenizer: Tokenizer
    file: GGUFFile  # raw metadata (`file.metadata`) and tensor table, for inspection
    _names: dict[str, str] = dataclasses.field(repr=False)  # HF name -> GGUF name, file order

    def tensor_names(self) -> list[str]:
        """HF names of every tensor `tensors()` yields, in file order (no lm_head when tied)."""
        return list(self._names)

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF name -> shape in HF orientation ([out_features, in_features] for linear layers)."""
        return {hf: self.file.tensors[g].shape for hf, g in self._names.items()}

    def tensor(self, hf_name: str) -> np.ndarray:
        """One tensor, dequantized to float32 in HF layout."""
        if hf_name not in self._names:
            raise ValueError(f"{hf_name=} is not in {str(self.path)!r}")
        info = self.file.tensors[self._names[hf_name]]
        return _to_hf_layout(dequantize(self.file, info), hf_name, self.hf_config)

    def tensor_type(self, hf_name: str) -> GGMLQuantizationType:
        return self.file.tensors[self._names[hf_name]].ggml_type

    def blocks(self, hf_name: str) -> Blocks:
        """A Q8_0 / Q4_0 / Q4_1 tensor's integer values and block scales, in HF layout (the rows
        reordered as `tensor()` does; blocks run along the last axis, which no reorder touches)."""
        info = self.file.tensors[self._names[hf_name]]
        b = decode_blocks(self.file.raw(info), info.ggml_type)
        fix = lambda a: None if a is None else _to_hf_layout(a, hf_name, self.hf_config)  # noqa: E731
        return Blocks(b.ggml_type, fix(b.q), fix(b.d), fix(b.m))

    def tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        """Yield (HF name, float32 array) one tensor at a time, dequantizing lazily."""
        for hf_name in self._names:
            yield hf_name, self.tensor(hf_name)

    def state_dict(self) -> dict[str, np.ndarray]:
        """All tensors at once (4 bytes per parameter); prefer `tensors()` for big models."""
        return dict(self.tensors())


def load_gguf(path: str | Path) -> GGUFCheckpoint:
    """Open a llama-family GGUF file and validate it; tensors are read later, on demand."""
    path = Path(path)
    file = read_gguf_file(path)
    names = _hf_names(file)
    for info in file.tensors.values():
        check_supported(path, info)
    rope_freqs = None
    if _ROPE_FREQS in file.tensors:
        rope_freqs = dequantize(file, file.tensors[_ROPE_FREQS])
    config = hf_config_from_gguf(file, rope_freqs)
    _check_shapes(file, names, config)
    tokenizer = tokenizer_from_gguf(file.metadata, path)
    return GGUFCheckpoint(path, config, tokenizer, file, names)


def _hf_names(file: GGUFFile) -> dict[str, str]:
    names: dict[str, str] = {}
    for gguf_name in file.tensors:
        if gguf_name == _ROPE_FREQS:
            continue
        if gguf_name in _TOP_NAMES:
            names[_TOP_NAMES[gguf_name]] = gguf_name
            continue
        m = _LAYER.match(gguf_name)
        if m is None or m.group(2) not in _LAYER_NAMES:
            # an unknown tensor means an architecture variant this loader would silently get wrong
            raise ValueError(
                f"{str(file.path)!r}: tensor {gguf_name!r} has no place in a llama-family model"
            )
        names[f"model.layers.{int(m.group(1))}.{_LAYER_NAMES[m.group(2)]}"] = gguf_name
    return names


def _expected_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    h, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    layer = {
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
        "mlp.gate_proj.weight": (i, h),
        "mlp.up_proj.weight": (i, h),
        "mlp.down_proj.weight": (h, i),
    }
    if config["attention_bias"]:
        layer |= {
            "self_attn.q_proj.bias": (q,),
            "self_attn.k_proj.bias": (kv,),
            "self_attn.v_proj.bias": (kv,),
        }
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, h)
    for n in range(config["num_hidden_layers"]):
        shapes |= {f"model.layers.{n}.{k}": s for k, s in layer.items()}
    return shapes


def _check_shapes(file: GGUFFile, names: dict[str, str], config: dict[str, Any]) -> None:
    expected = _expected_shapes(config)
    where = str(file.path)
    for hf_name, shape in expected.items():
        if hf_name not in names:
            raise ValueError(f"{where!r}: tensor for {hf_name!r} is missing from the file")
        info: GGUFTensorInfo = file.tensors[names[hf_name]]
        if info.shape != shape:
            raise ValueError(
                f"{where!r}: tensor {info.name!r} has shape {info.shape} (HF layout), the config "
                f"implies {shape}"
            )
    for hf_name, gguf_name in names.items():
        if hf_name not in expected:
            raise ValueError(f"{where!r}: tensor {gguf_name!r} does not fit this model's config")


def _to_hf_layout(array: np.ndarray, hf_name: str, config: dict[str, Any]) -> np.ndarray:
    if config["model_type"] != "llama":
        return array
    if ".self_attn.q_proj." in hf_name:
        return _unpermute_rows(array, config["num_attention_heads"])
    if ".self_attn.k_proj." in hf_name:
        return _unpermute_rows(array, config["num_key_value_heads"])
    return array


def _unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row order [d/2, 2] back to HF's [2, d/2] (weights or biases)."""
    rest = w.shape[1:]
    half = w.shape[0] // n_heads // 2
    return np.ascontiguousarray(w.reshape(n_heads, half, 2, *rest).swapaxes(1, 2)).reshape(w.shape)
