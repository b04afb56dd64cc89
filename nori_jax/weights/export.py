"""The model's weights as a Hugging Face checkpoint names and lays them out: the loader's mapping
run backwards (hf_names.hf_name; kernels transposed back to [out, in]; fused q/k/v and gate/up
split into their parts, models/fused_layout.py). A trainer can start from the engine's weights
this way, and hand its own back through `update_weights`, which takes the same names.

The transposes run on the device, a block of columns at a time: numpy transposes a 2-byte dtype
at about 0.4 GB/s (0.30 s for one 4,096 x 14,336 bf16 kernel on the CPU machine), which made an
8B model's export take 89 s on an H100 (docs/benchmarks.md); the device does it at its copy rate,
with at most `BLOCK_BYTES` of memory beyond the weights.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator

import jax
import numpy as np
from flax import nnx
from jax import lax

from nori_jax.models.fused_layout import unfuse_gate_up, unfuse_qkv
from nori_jax.weights import hf_names
from nori_jax.weights.loader import LoadedModel


def hf_tensors(
    loaded: LoadedModel, flat: Iterable[tuple[tuple, jax.Array]] | None = None
) -> Iterator[tuple[str, np.ndarray]]:
    """(Hugging Face name, host array) for every weight of a float model, one at a time (each
    brought from the device as it is yielded). `flat`: the (path, array) pairs to read, where
    the state does not hold them all (a runner's `flat_weights`); default the state's.
    ValueError for a quantized model, whose stored values are not a checkpoint's floats."""
    if loaded.quantization is not None:
        raise ValueError(
            f"the weights are stored quantized ({loaded.quantization.describe()}); export "
            "needs a float model"
        )
    cfg = loaded.config
    if flat is None:
        flat = ((path, var.get_value()) for path, var in nnx.to_flat_state(loaded.state))
    for path, value in flat:
        if isinstance(value, jax.ShapeDtypeStruct):
            raise ValueError("the engine sleeps without its weights (level 2): nothing to export")
        name, transpose = hf_names.hf_name(path)
        array = host_transposed(value) if transpose else np.asarray(jax.device_get(value))
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


BLOCK_BYTES = 256 << 20  # device memory a transpose block may take


def host_transposed(x: jax.Array) -> np.ndarray:
    """`x.T` ([in, out] -> [out, in]) on the host, C-contiguous, transposed on the device in
    blocks of columns of at most BLOCK_BYTES (the next block is launched before this one is
    read back). The last block starts early enough to be full (one program per shape), writing
    some rows twice."""
    rows, cols = x.shape
    width = max(1, min(cols, BLOCK_BYTES // max(1, rows * x.dtype.itemsize)))
    out = np.empty((cols, rows), x.dtype)
    starts = [min(s, cols - width) for s in range(0, cols, width)]
    pending = _columns_transposed(x, starts[0], width)
    for i, start in enumerate(starts):
        block = pending
        if i + 1 < len(starts):
            pending = _columns_transposed(x, starts[i + 1], width)
        out[start : start + width] = np.asarray(block)
    return out


@functools.partial(jax.jit, static_argnums=2)
def _columns_transposed(x: jax.Array, start, width: int) -> jax.Array:
    return lax.dynamic_slice_in_dim(x, start, width, axis=1).T
