"""Dequantizing GGUF tensors to float32 numpy arrays with the `gguf` package's reference kernels.

Supported: the float types, the legacy block quants (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) and the K-quants
(Q2_K..Q6_K), which together cover the files llama.cpp's `quantize` writes for llama-family models
(a Q4_K_M file holds Q4_K and Q6_K tensors). The i-quants (IQ*), ternary (TQ*) and FP4 types are
refused with a ValueError naming the tensor: `gguf` can decode some of them, but nothing here checks
those decoders against an independent implementation, so they are not offered.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import quants
from gguf.constants import GGMLQuantizationType as Q

from nori_jax.weights.gguf_file import GGUFFile, GGUFTensorInfo

SUPPORTED_TYPES: frozenset[Q] = frozenset(
    {Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0}
    | {Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K}
)


def check_supported(path: Path, info: GGUFTensorInfo) -> None:
    if info.ggml_type not in SUPPORTED_TYPES:
        names = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise ValueError(
            f"{str(path)!r}: tensor {info.name!r} is stored as {info.type_name}, which is not "
            f"supported; supported types: {names}"
        )


def dequantize(file: GGUFFile, info: GGUFTensorInfo) -> np.ndarray:
    """The tensor as a fresh, writable float32 array of shape `info.shape` (numpy order)."""
    check_supported(file.path, info)
    raw = file.raw(info)
    try:
        values = quants.dequantize(raw, info.ggml_type)
    except (ValueError, NotImplementedError) as e:
        raise ValueError(f"{str(file.path)!r}: cannot dequantize tensor {info.name!r}: {e}") from e
    out = np.asarray(values, dtype=np.float32).reshape(info.shape)
    if not out.flags.writeable:  # F32 comes back as a view of the read-only memmap
        out = out.copy()
    return out
