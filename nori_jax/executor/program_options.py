"""XLA options compiled into the engine's own programs (`Lowered.compile(compiler_options=...)`),
where a process-wide XLA_FLAGS setting (xla_flags.py) would reach every other program too.

fp8 weights: XLA's Triton GEMM fusions off, so each fp8 dot goes to cuBLASLt. With them on, XLA
autotunes Triton candidates for every fp8 dot fusion of every bucket: the Llama-3.1-8B shape's
start-up ran past 320 s with one bucket taking 251 s (docs/benchmarks.md, "Weight quantization
on the GPU"). Off, a small engine of that shape was ready in 46 s and ran at 12,919 total tok/s;
XLA's autotuning switched off instead (`--xla_gpu_autotune_level=0`) was ready in 41 s but ran
at 1,138, its untuned GEMMs ten times slower. The weight-only modes keep the Triton fusions: they
are what dequantizes int8 / int4 weights inside the GEMM.

With `quantized_matmul="upcast"` (fp8's default), fp8 layers in calls of up to 64 tokens are
weight-only too (models/linear.py): a forward pass whose bucket is that small holds no fp8 dot,
so it keeps the Triton fusions that convert the fp8 weight inside the GEMM (`for_weights(...,
bucket, small_matmul)`); without them XLA would write the converted weight out first.

The runner's programs and the KV-scale calibration's prefill (kv_calibration.py) compile with
these options. A user's own `--xla_gpu_enable_triton_gemm` in XLA_FLAGS stands: the engine then
adds nothing.
"""

from __future__ import annotations

import os

from nori_jax.executor.xla_flags import setting as flag_setting
from nori_jax.models.linear import UPCAST_MAX_TOKENS
from nori_jax.quantization import WeightQuantization

TRITON_GEMM = "xla_gpu_enable_triton_gemm"


def user_sets(option: str, xla_flags: str | None = None) -> bool:
    """Whether XLA_FLAGS (`xla_flags`, default the environment's) names `option`."""
    flags = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
    return flag_setting(flags, option) is not None


def for_weights(
    quantization: WeightQuantization | None,
    xla_flags: str | None = None,
    *,
    bucket: int | None = None,
    small_matmul: str = "xla",
) -> dict[str, bool]:
    """The compiler options of the engine's programs for weights stored as `quantization`; for
    a forward pass of `bucket` tokens, where the model's `small_matmul` makes it weight-only."""
    if quantization is None or quantization.mode != "fp8" or user_sets(TRITON_GEMM, xla_flags):
        return {}
    if small_matmul == "upcast" and bucket is not None and bucket <= UPCAST_MAX_TOKENS:
        return {}
    return {TRITON_GEMM: False}
