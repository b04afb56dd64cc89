"""How the linear layers' weights are stored: the `quantization` modes and their layouts.

    fp8   float8_e4m3fn weights, one scale per output channel; activations quantized to fp8 per
          token at run time, so the matmul runs in fp8 (XLA's fp8 dot: cuBLASLt on Hopper)
    int8  int8 weights, one scale per output channel (or per block of 32 inputs when the
          checkpoint is GGUF Q8_0: its own blocks, kept as they are); weight-only
    int4  int4 weights, one scale per group of 128 inputs (or 32 with GGUF Q4_0 / Q4_1 blocks,
          kept; Q4_1's per-block minimum becomes a float offset); weight-only

A quantized linear stores `qvalue[out, in]` (Hugging Face's orientation: the contracted axis is
the minor one, which the fp8 GEMM requires), `scale[out, in // group]` (`[out, 1]` per channel)
and, only for offset layouts, `offset[out, in // group]`; the weight is
`qvalue * scale (+ offset)` with the scale broadcast over each group. Embeddings, the LM head and
the norms stay in the compute dtype (as vLLM keeps them).

JAX-free (ml_dtypes' types are JAX's): EngineConfig validates against this module in processes
that never load JAX.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

QUANTIZATION_MODES = ("fp8", "int8", "int4")
DEFAULT_GROUP_SIZE = {"fp8": None, "int8": None, "int4": 128}
GGUF_BLOCK = 32  # the legacy GGUF quants (Q4_0, Q4_1, Q8_0) scale blocks of 32 inputs


@dataclasses.dataclass(frozen=True)
class WeightQuantization:
    mode: str  # one of QUANTIZATION_MODES
    group_size: int | None = None  # inputs per scale; None: one scale per output channel
    offset: bool = False  # a float offset per group (GGUF Q4_1's minimum)
    source: str = "quantized at load"  # where the values come from, for logs and /metrics

    def __post_init__(self) -> None:
        if self.mode not in QUANTIZATION_MODES:
            raise ValueError(f"quantization={self.mode!r} must be one of {QUANTIZATION_MODES}")
        if self.group_size is not None and self.group_size < 1:
            raise ValueError(f"group_size={self.group_size} must be >= 1 or None (per channel)")
        if self.offset and (self.mode != "int4" or self.group_size is None):
            raise ValueError(
                f"an offset per group exists only for group-wise int4, not {self.describe()}"
            )
        if self.mode == "fp8" and self.group_size is not None:
            raise ValueError(
                "quantization='fp8' scales whole output channels (group_size=None); "
                f"group_size={self.group_size} is not supported"
            )

    @property
    def qtype(self):
        """The stored values' dtype."""
        if self.mode == "fp8":
            return ml_dtypes.float8_e4m3fn
        if self.mode == "int8":
            return np.int8
        return ml_dtypes.int4

    @property
    def quantizes_activations(self) -> bool:
        return self.mode == "fp8"

    def scale_dtype(self, compute_dtype):
        """fp8 scales multiply the float32 GEMM output, so they stay float32; the weight-only
        modes dequantize into the compute dtype, which is the scales' dtype (qwix's rule)."""
        return np.float32 if self.mode == "fp8" else compute_dtype

    def num_groups(self, in_features: int) -> int:
        return 1 if self.group_size is None else in_features // self.group_size

    def check_in_features(self, name: str, in_features: int) -> None:
        g = self.group_size
        if g is not None and in_features % g:
            raise ValueError(
                f"quantization={self.mode!r} with groups of {g} inputs needs every linear "
                f"layer's input size to be a multiple of {g}: {name} has {in_features} inputs "
                f"({in_features} % {g} = {in_features % g})"
            )

    def describe(self) -> str:
        layout = "per channel" if self.group_size is None else f"groups of {self.group_size}"
        extra = ", float offset" if self.offset else ""
        return f"{self.mode} ({np.dtype(self.qtype).name}, {layout}{extra}; {self.source})"


def default_scheme(mode: str) -> WeightQuantization:
    if mode not in QUANTIZATION_MODES:
        raise ValueError(f"quantization={mode!r} must be one of {QUANTIZATION_MODES}")
    return WeightQuantization(mode, DEFAULT_GROUP_SIZE[mode])
