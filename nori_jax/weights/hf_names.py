"""Map Hugging Face Llama-family tensor names onto the NNX model's state paths.

HF stores linear weights [out_features, in_features]; the model keeps kernels [in, out], so those
are transposed on the way in. Every loader (safetensors, GGUF) yields HF names, so this table is the
single place that knows the model's parameter layout.
"""

from __future__ import annotations

import re

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_LAYER_PARAMS: dict[str, tuple[tuple[str, ...], bool]] = {
    "self_attn.q_proj.weight": (("self_attn", "q_proj"), True),
    "self_attn.k_proj.weight": (("self_attn", "k_proj"), True),
    "self_attn.v_proj.weight": (("self_attn", "v_proj"), True),
    "self_attn.o_proj.weight": (("self_attn", "o_proj"), True),
    "self_attn.q_proj.bias": (("self_attn", "q_bias"), False),
    "self_attn.k_proj.bias": (("self_attn", "k_bias"), False),
    "self_attn.v_proj.bias": (("self_attn", "v_bias"), False),
    "mlp.gate_proj.weight": (("mlp", "gate_proj"), True),
    "mlp.up_proj.weight": (("mlp", "up_proj"), True),
    "mlp.down_proj.weight": (("mlp", "down_proj"), True),
    # the fused projections (models/fused_layout.py), built by the loader from the parts above
    "self_attn.qkv_proj.weight": (("self_attn", "qkv_proj"), True),
    "self_attn.qkv_proj.bias": (("self_attn", "qkv_bias"), False),
    "mlp.gate_up_proj.weight": (("mlp", "gate_up_proj"), True),
    "input_layernorm.weight": (("input_layernorm", "weight"), False),
    "post_attention_layernorm.weight": (("post_attention_layernorm", "weight"), False),
}
_TOP_PARAMS: dict[str, tuple[tuple[str, ...], bool]] = {
    "model.embed_tokens.weight": (("embed_tokens",), False),
    "model.norm.weight": (("norm", "weight"), False),
    "lm_head.weight": (("lm_head",), True),
}
# The decoder's linear projections: what `quantization=` stores quantized (never embeddings or
# the LM head).
_LINEAR = re.compile(
    r"^model\.layers\.\d+\.(self_attn\.([qkvo]|qkv)_proj|mlp\.(gate|up|down|gate_up)_proj)"
    r"\.weight$"
)
# Fused tensors and the checkpoint tensors they are built from, in order.
FUSED_PARTS: dict[str, tuple[str, ...]] = {
    "self_attn.qkv_proj.weight": tuple(f"self_attn.{p}_proj.weight" for p in "qkv"),
    "self_attn.qkv_proj.bias": tuple(f"self_attn.{p}_proj.bias" for p in "qkv"),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}
_PART_OF = {p: (fused, i) for fused, parts in FUSED_PARTS.items() for i, p in enumerate(parts)}
# Buffers some checkpoints carry that the model recomputes.
_IGNORED = re.compile(r"(rotary_emb\.inv_freq|\.rotary_emb\.)")


def state_path(hf_name: str) -> tuple[tuple[str | int, ...], bool] | None:
    """(state path, transpose?) for a tensor name; None for buffers the model does not store.

    Raises ValueError for a name the model does not know, so a wrong checkpoint fails loudly.
    """
    if _IGNORED.search(hf_name):
        return None
    if hf_name in _TOP_PARAMS:
        return _TOP_PARAMS[hf_name]
    m = _LAYER.match(hf_name)
    if m and m.group(2) in _LAYER_PARAMS:
        sub, transpose = _LAYER_PARAMS[m.group(2)]
        return ("layers", int(m.group(1)), *sub), transpose
    raise ValueError(f"tensor {hf_name!r} does not belong to a Llama-family model")


def is_linear_weight(hf_name: str) -> bool:
    """A decoder layer's projection weight (q/k/v/o, gate/up/down)."""
    return _LINEAR.match(hf_name) is not None


def fused_part(hf_name: str) -> tuple[str, int, int] | None:
    """(fused tensor's name, this part's index, number of parts) for a layer tensor that a fused
    projection is built from (q/k/v weights and biases, gate/up weights); None otherwise."""
    m = _LAYER.match(hf_name)
    if not m or m.group(2) not in _PART_OF:
        return None
    fused, i = _PART_OF[m.group(2)]
    return f"model.layers.{m.group(1)}.{fused}", i, len(FUSED_PARTS[fused])


def hf_name(path: tuple[str | int, ...]) -> tuple[str, bool]:
    """(tensor name, transposed?) of a state path: `state_path`'s inverse, for the fused
    projections too (weights/export.py splits them)."""
    if path[0] == "layers":
        for suffix, (sub, transpose) in _LAYER_PARAMS.items():
            if tuple(path[2:]) == sub:
                return f"model.layers.{path[1]}.{suffix}", transpose
    for name, (top, transpose) in _TOP_PARAMS.items():
        if tuple(path) == top:
            return name, transpose
    raise ValueError(f"state path {path} has no Hugging Face name")
