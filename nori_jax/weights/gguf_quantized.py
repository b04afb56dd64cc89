"""GGUF tensors that are already 8- or 4-bit, loaded into the matching quantization mode as they
are (no round trip through a float dtype).

    file's linear layers     quantization   stored as                                   exact?
    all Q8_0                 int8           int8, scale per block of 32                 yes
    all Q4_0                 int4           int4 (q - 8), scale per block of 32         yes
    all Q4_0 / Q4_1          int4           int4 (q - 8), scale and float offset per    yes*
                                            block (Q4_1: m + 8 d; Q4_0: 0)
    anything else            any            the mode's own layout, quantized from the   no
                                            file's float32 dequantization

"Exact" means the dequantized weight is llama.cpp's value bit for bit in float32 (every product of
an fp16 scale and a small integer is exact there). *Q4_1's d * q + m becomes d * (q - 8) + (m + 8 d)
so that all int4 weights share one signed storage type (orbax and XLA's int4 paths know int4, not
uint4): the offset m + 8 d is rounded once to float32, a relative 2^-24. In a bfloat16 engine the
scales and offsets are rounded to bfloat16 like any float weight would be. The block size stays
32, not int4's default group of 128: merging blocks would mean re-quantizing. Embeddings and the
LM head are dequantized to the compute dtype in every mode.
"""

from __future__ import annotations

from collections.abc import Iterable

import jax.numpy as jnp
import numpy as np
from gguf.constants import GGMLQuantizationType as Q

from nori_jax.quantization.quantize import QuantizedTensor
from nori_jax.quantization.scheme import WeightQuantization, default_scheme
from nori_jax.weights.gguf_blocks import BLOCK, Blocks


def gguf_scheme(mode: str, linear_types: Iterable[Q]) -> tuple[WeightQuantization, bool]:
    """The layout for `mode` given the GGUF types of the file's linear-layer tensors, and whether
    it stores the file's blocks as they are (True) or re-quantizes float32 values (False)."""
    types = set(linear_types)
    names = "/".join(sorted(t.name for t in types))
    if mode == "int8" and types == {Q.Q8_0}:
        return WeightQuantization("int8", BLOCK, source="GGUF Q8_0 blocks, exact"), True
    if mode == "int4" and types == {Q.Q4_0}:
        return WeightQuantization("int4", BLOCK, source="GGUF Q4_0 blocks, exact"), True
    if mode == "int4" and types <= {Q.Q4_0, Q.Q4_1}:
        source = f"GGUF {names} blocks, exact"
        return WeightQuantization("int4", BLOCK, offset=True, source=source), True
    scheme = default_scheme(mode)
    source = f"quantized at load from GGUF {names} (dequantized to float32)"
    return WeightQuantization(scheme.mode, scheme.group_size, source=source), False


def blocks_to_tensor(blocks: Blocks, scheme: WeightQuantization) -> QuantizedTensor:
    """One tensor's blocks in the layout `gguf_scheme` chose for the file."""
    t = blocks.ggml_type
    if t == Q.Q8_0 and scheme.mode == "int8":
        return QuantizedTensor(blocks.q, blocks.d)
    if t in (Q.Q4_0, Q.Q4_1) and (scheme.offset or t == Q.Q4_0):
        q = (blocks.q - 8).astype(jnp.int4)
        if not scheme.offset:
            return QuantizedTensor(q, blocks.d)
        offset = blocks.m + np.float32(8) * blocks.d if t == Q.Q4_1 else np.zeros_like(blocks.d)
        return QuantizedTensor(q, blocks.d, offset)
    raise ValueError(f"GGUF {t.name} blocks do not fit {scheme.describe()}")
