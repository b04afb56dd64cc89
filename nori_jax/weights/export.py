"""The model's weights as a Hugging Face checkpoint names and lays them out: the loader's mapping
run backwards (hf_names.hf_name; kernels transposed back to [out, in]; fused q/k/v and gate/up
split into their parts, models/fused_layout.py). A trainer can start from the engine's weights
this way, and hand its own back through `update_weights`, which takes the same names.
"""

from __future__ import annotations

from collections.abc import Iterator

import jax
import numpy as np
from flax import nnx

from nori_jax.models.fused_layout import unfuse_gate_up, unfuse_qkv
from nori_jax.weights import hf_names
from nori_jax.weights.loader import LoadedModel


def hf_tensors(loaded: LoadedModel) -> Iterator[tuple[str, np.ndarray]]:
    """(Hugging Face name, host array) for every weight of a float model, one at a time (each
    brought from the device as it is yielded). ValueError for a quantized model, whose stored
    values are not a checkpoint's floats."""
    if loaded.quantization is not None:
        raise ValueError(
            f"the weights are stored quantized ({loaded.quantization.describe()}); export "
            "needs a float model"
        )
    cfg = loaded.config
    for path, var in nnx.to_flat_state(loaded.state):
        value = var.get_value()
        if isinstance(value, jax.ShapeDtypeStruct):
            raise ValueError("the engine sleeps without its weights (level 2): nothing to export")
        name, transpose = hf_names.hf_name(path)
        array = np.asarray(jax.device_get(value))
        if transpose:
            array = array.T
        layer = name.rsplit(".", 3)[0] if name.startswith("model.layers.") else ""
        if name.endswith(("self_attn.qkv_proj.weight", "self_attn.qkv_proj.bias")):
            kind = name.rsplit(".", 1)[1]
            parts = unfuse_qkv(array, cfg.num_heads, cfg.num_kv_heads)
            for p, part in zip("qkv", parts, strict=True):
                yield f"{layer}.self_attn.{p}_proj.{kind}", np.ascontiguousarray(part)
        elif name.endswith("mlp.gate_up_proj.weight"):
            for p, part in zip(("gate", "up"), unfuse_gate_up(array), strict=True):
                yield f"{layer}.mlp.{p}_proj.weight", np.ascontiguousarray(part)
        else:
            yield name, np.ascontiguousarray(array)
