"""Tiny synthetic GGUF files written with `gguf.GGUFWriter`, laid out as llama.cpp's converter does.

`write_tiny_gguf` returns the random HF-layout weights it wrote, to check a loader against.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf.constants import GGMLQuantizationType as Q


@dataclasses.dataclass(frozen=True)
class TinyModel:
    arch: str = "llama"
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    intermediate: int = 128
    layers: int = 2
    tie: bool = False
    bias: bool = False  # q/k/v biases (Qwen2)
    rope_theta: float = 10000.0


def byte_alphabet() -> list[str]:
    """GPT-2's printable stand-in for each byte value 0..255 (the byte-level BPE alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # CONTROL
USER_DEFINED = ["<think>"]
MERGES = ["Ġ t", "h e", "Ġt he", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld"]
# "Ġxyz": a whole-word token no merge builds, which only `ignore_merges` (Llama 3) reaches
TOKENS = SPECIALS + USER_DEFINED + byte_alphabet() + [m.replace(" ", "") for m in MERGES] + ["Ġxyz"]
TOKEN_TYPES = [3] * len(SPECIALS) + [4] * len(USER_DEFINED) + [1] * (len(TOKENS) - 4)
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """As llama.cpp's converter does: per head, rows [2, d/2] (HF) become [d/2, 2]."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_weights(m: TinyModel, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    q, kv, v = m.heads * m.head_dim, m.kv_heads * m.head_dim, len(TOKENS)

    def normal(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    out = {"model.embed_tokens.weight": normal(v, m.hidden)}
    for i in range(m.layers):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": 1 + 0.1 * normal(m.hidden),
            p + "post_attention_layernorm.weight": 1 + 0.1 * normal(m.hidden),
            p + "self_attn.q_proj.weight": normal(q, m.hidden),
            p + "self_attn.k_proj.weight": normal(kv, m.hidden),
            p + "self_attn.v_proj.weight": normal(kv, m.hidden),
            p + "self_attn.o_proj.weight": normal(m.hidden, q),
            p + "mlp.gate_proj.weight": normal(m.intermediate, m.hidden),
            p + "mlp.up_proj.weight": normal(m.intermediate, m.hidden),
            p + "mlp.down_proj.weight": normal(m.hidden, m.intermediate),
        }
        if m.bias:
            out |= {
                p + f"self_attn.{x}_proj.bias": normal(n)
                for x, n in (("q", q), ("k", kv), ("v", kv))
            }
    out["model.norm.weight"] = 1 + 0.1 * normal(m.hidden)
    if not m.tie:
        out["lm_head.weight"] = normal(v, m.hidden)
    return out


_GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf_name: str) -> str:
    if hf_name in _GGUF_NAMES:
        return _GGUF_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_GGUF_NAMES[rest]}"


def add_tensor(writer: gguf.GGUFWriter, name: str, w: np.ndarray, qtype: Q) -> None:
    if qtype == Q.F32:
        writer.add_tensor(name, w.astype(np.float32))
    elif qtype == Q.F16:
        writer.add_tensor(name, w.astype(np.float16))
    else:
        writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)


def write_tiny_gguf(
    path: Path,
    m: TinyModel = TinyModel(),
    qtype: Q = Q.F32,
    *,
    seed: int = 0,
    pre: str = "smollm",
    add_bos: bool | None = False,
    extra_metadata: dict[str, Any] | None = None,
    extra_tensors: dict[str, tuple[np.ndarray, Q]] | None = None,
    types: dict[str, Q] | None = None,
    skip: tuple[str, ...] = (),
) -> dict[str, np.ndarray]:
    """Write a tiny model to `path`; returns its HF-layout float32 weights (before quantization).

    2-D weights are stored as `qtype` (or `types[gguf_name]`), norms and biases as F32 (llama.cpp).
    """
    weights = hf_weights(m, seed)
    writer = gguf.GGUFWriter(str(path), m.arch)
    a = m.arch
    writer.add_uint32(f"{a}.context_length", 256)
    writer.add_uint32(f"{a}.embedding_length", m.hidden)
    writer.add_uint32(f"{a}.block_count", m.layers)
    writer.add_uint32(f"{a}.feed_forward_length", m.intermediate)
    writer.add_uint32(f"{a}.attention.head_count", m.heads)
    writer.add_uint32(f"{a}.attention.head_count_kv", m.kv_heads)
    writer.add_float32(f"{a}.rope.freq_base", m.rope_theta)
    writer.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_uint32(f"{a}.rope.dimension_count", m.head_dim)
    if m.head_dim != m.hidden // m.heads:
        writer.add_uint32(f"{a}.attention.key_length", m.head_dim)
        writer.add_uint32(f"{a}.attention.value_length", m.head_dim)
    writer.add_uint32(f"{a}.vocab_size", len(TOKENS))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(TOKENS)
    writer.add_token_types(TOKEN_TYPES)
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    writer.add_chat_template(CHAT_TEMPLATE)
    for key, value in (extra_metadata or {}).items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)

    for hf_name, w in weights.items():
        name = gguf_name(hf_name)
        if name in skip:
            continue
        stored = w
        if m.arch == "llama" and ".q_proj." in hf_name:
            stored = llama_cpp_permute(w, m.heads)
        elif m.arch == "llama" and ".k_proj." in hf_name:
            stored = llama_cpp_permute(w, m.kv_heads)
        t = (types or {}).get(name, qtype if w.ndim == 2 else Q.F32)
        add_tensor(writer, name, stored, t)
    for name, (w, t) in (extra_tensors or {}).items():
        if t in (Q.F32, Q.F16):
            add_tensor(writer, name, w, t)
        else:
            writer.add_tensor(name, w, raw_dtype=t)  # raw blocks, shape in bytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return weights
