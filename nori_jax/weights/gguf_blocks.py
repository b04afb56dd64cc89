"""GGUF's 32-value blocks (Q8_0, Q4_0, Q4_1) as integer values and per-block scales, undequantized.

The `gguf` package decodes blocks only into floats; a quantized engine wants the integers and the
scales themselves, so they are unpacked here (llama.cpp's block layouts, little-endian):

    Q8_0  34 bytes: fp16 d, int8 q[32]                     value = d * q
    Q4_0  18 bytes: fp16 d, 16 bytes of nibbles            value = d * (q - 8),  q in 0..15
    Q4_1  20 bytes: fp16 d, fp16 m, 16 bytes of nibbles    value = d * q + m,    q in 0..15

Byte j of the nibbles holds value j in its low nibble and value j + 16 in its high nibble. Tests
check `q`, `d` and `m` against `gguf.quants.dequantize` value for value.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from gguf.constants import GGMLQuantizationType as Q

BLOCK = 32
BLOCK_TYPES = (Q.Q8_0, Q.Q4_0, Q.Q4_1)
_HEADER_BYTES = {Q.Q8_0: 2, Q.Q4_0: 2, Q.Q4_1: 4}


@dataclasses.dataclass(frozen=True)
class Blocks:
    """One tensor's blocks: `q[..., n]` (int8: Q8_0 in -128..127, Q4_0 and Q4_1 raw nibbles in
    0..15), `d[..., n // 32]` and, for Q4_1, `m[..., n // 32]` (float32, exact from fp16)."""

    ggml_type: Q
    q: np.ndarray
    d: np.ndarray
    m: np.ndarray | None

    def dequantize(self) -> np.ndarray:
        """float32 values, as llama.cpp computes them (every product here is exact in float32)."""
        q = self.q.astype(np.float32).reshape(*self.d.shape, BLOCK)
        if self.ggml_type == Q.Q4_0:
            q = q - 8
        out = q * self.d[..., None]
        if self.m is not None:
            out = out + self.m[..., None]
        return out.reshape(self.q.shape)


def decode_blocks(raw: np.ndarray, ggml_type: Q) -> Blocks:
    """`raw[..., bytes_per_row]` (GGUFFile.raw) as integer values and scales of shape [..., n]."""
    if ggml_type not in BLOCK_TYPES:
        raise ValueError(f"{ggml_type.name} is not one of the 32-value block types {BLOCK_TYPES}")
    lead = raw.shape[:-1]
    header = _HEADER_BYTES[ggml_type]
    blocks = np.ascontiguousarray(raw).reshape(*lead, -1, header + _payload_bytes(ggml_type))
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = None
    if ggml_type == Q.Q4_1:
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    payload = blocks[..., header:]
    if ggml_type == Q.Q8_0:
        q = payload.copy().view(np.int8)
    else:
        q = np.concatenate([payload & 0x0F, payload >> 4], axis=-1).astype(np.int8)
    return Blocks(ggml_type, q.reshape(*lead, -1), d, m)


def _payload_bytes(ggml_type: Q) -> int:
    return BLOCK if ggml_type == Q.Q8_0 else BLOCK // 2
