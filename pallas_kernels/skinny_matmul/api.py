"""`skinny_matmul`: validated inputs, the tuning chosen per shape, the splits added."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import device_info
from pallas_kernels.skinny_matmul.kernel import launch
from pallas_kernels.skinny_matmul.tuning import ROW_BYTES, ROWS, SkinnyTuning, default_tuning

W_LAYOUTS = ("out_in", "in_out")
FP8 = (jnp.float8_e4m3fn, jnp.float8_e5m2)
MAX_TOKENS = 256  # wgmma's largest N
INTERPRET_NUM_SMS = 2  # interpret mode: a small grid, still split over the contracted axis


def check_inputs(x, w, *, w_layout: str, tuning: SkinnyTuning | None, num_sms: int) -> SkinnyTuning:
    """Raises ValueError for what the kernel does not take; returns the tuning to run."""
    if w_layout not in W_LAYOUTS:
        raise ValueError(f"{w_layout=} must be one of {W_LAYOUTS}")
    if x.ndim != 2 or w.ndim != 2:
        raise ValueError(f"{x.shape=} and {w.shape=} must both be 2-D")
    num_tokens, k = x.shape
    wk, n = w.shape if w_layout == "in_out" else w.shape[::-1]
    if wk != k:
        raise ValueError(f"{x.shape=} and {w.shape=} ({w_layout}) contract different lengths")
    if num_tokens % 8 or not 8 <= num_tokens <= MAX_TOKENS:
        raise ValueError(f"{num_tokens=} must be a multiple of 8 from 8 to {MAX_TOKENS}")
    if n % ROWS:
        raise ValueError(f"{n=} output features must be a multiple of {ROWS}")
    fp8 = x.dtype in FP8
    int8 = w.dtype == jnp.int8 and x.dtype in (jnp.bfloat16, jnp.float16)
    if not int8 and (fp8 != (w.dtype in FP8) or (not fp8 and x.dtype != w.dtype)):
        raise ValueError(
            f"{x.dtype=} and {w.dtype=} must both be fp8, the same type, or bf16/f16 with int8"
        )
    if (fp8 or int8) and w_layout != "out_in":
        raise ValueError(f"8-bit weights must be stored out_in (K-major), got {w_layout=}")
    if x.dtype not in (*FP8, jnp.bfloat16, jnp.float16):
        raise ValueError(f"{x.dtype=} must be bfloat16, float16 or fp8")
    tn = tuning or default_tuning(num_tokens, k, n, w.dtype.itemsize, num_sms, x.dtype.itemsize)
    if k % (tn.block_k * tn.splits):
        raise ValueError(f"{k=} must be a multiple of block_k * splits ({tn})")
    return tn


def skinny_matmul_fits(num_tokens: int, in_features: int, out_features: int, itemsize: int) -> bool:
    """Whether the kernel takes this shape under its default tuning (whose splits always divide
    the contracted blocks)."""
    if num_tokens % 8 or not 8 <= num_tokens <= MAX_TOKENS or out_features % ROWS:
        return False
    return in_features % (ROW_BYTES // itemsize) == 0


@functools.partial(jax.jit, static_argnames=("w_layout", "tuning", "interpret"))
def skinny_matmul(
    x: jax.Array,  # [T, K]
    w: jax.Array,  # [N, K] (w_layout "out_in") or [K, N] ("in_out")
    *,
    w_layout: str,
    tuning: SkinnyTuning | None = None,
    interpret: bool | None = None,
) -> jax.Array:  # float32 [T, N]
    """x @ w^T (out_in) or x @ w (in_out) in float32, for T of 8 to 256 tokens (a multiple of 8):
    the weight is read once, split over enough CTAs to fill the GPU. bf16 / f16 x with a weight of
    the same type or an int8 weight (converted in registers), or fp8 x with an fp8 weight; 8-bit
    weights stored out_in (scales are the caller's). On CPU it runs in Mosaic GPU interpret mode."""
    if interpret is None:
        interpret = device_info.on_cpu()
    tn = check_inputs(x, w, w_layout=w_layout, tuning=tuning, num_sms=_num_sms(interpret))
    partials = launch(x, w, w_layout=w_layout, tn=tn, interpret=interpret)
    return partials.sum(0).T


def _num_sms(interpret: bool) -> int:
    return INTERPRET_NUM_SMS if interpret else device_info.num_sms()
