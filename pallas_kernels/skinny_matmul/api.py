"""`skinny_matmul`: validated inputs, the tuning chosen per shape, the splits added."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import device_info
from pallas_kernels.skinny_matmul.kernel import launch, scale_block
from pallas_kernels.skinny_matmul.tuning import ROW_BYTES, ROWS, SkinnyTuning, default_tuning

W_LAYOUTS = ("out_in", "in_out")
FP8 = (jnp.float8_e4m3fn, jnp.float8_e5m2)
INTEGER_WEIGHTS = (jnp.int8, jnp.int4)  # weight-only: converted in registers
SWIZZLES = (32, 64, 128)  # bytes of a swizzled SMEM row
MAX_TOKENS = 256  # wgmma's largest N
INTERPRET_NUM_SMS = 2  # interpret mode: a small grid, still split over the contracted axis


def check_inputs(
    x, w, group_scales=None, *, w_layout: str, tuning: SkinnyTuning | None, num_sms: int
) -> SkinnyTuning:
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
    integer = w.dtype in INTEGER_WEIGHTS and x.dtype in (jnp.bfloat16, jnp.float16)
    if not integer and (fp8 != (w.dtype in FP8) or (not fp8 and x.dtype != w.dtype)):
        raise ValueError(
            f"{x.dtype=} and {w.dtype=} must both be fp8, the same type, or bf16/f16 with an "
            "int8 or int4 weight"
        )
    if (fp8 or integer) and w_layout != "out_in":
        raise ValueError(f"8- and 4-bit weights must be stored out_in (K-major), got {w_layout=}")
    if x.dtype not in (*FP8, jnp.bfloat16, jnp.float16):
        raise ValueError(f"{x.dtype=} must be bfloat16, float16 or fp8")
    w_itemsize = jax.dtypes.itemsize_bits(w.dtype) / 8
    group = None
    if group_scales is not None:
        group = _check_group_scales(group_scales, k, n, w, integer)
        if tuning is not None and tuning.block_k != group:
            raise ValueError(f"{tuning=}: block_k must be the scales' group of {group} inputs")
    tn = tuning or default_tuning(
        num_tokens, k, n, w_itemsize, num_sms, x.dtype.itemsize, block_k=group
    )
    if k % (tn.block_k * tn.splits):
        raise ValueError(f"{k=} must be a multiple of block_k * splits ({tn})")
    return tn


def _check_group_scales(group_scales, k: int, n: int, w, integer: bool) -> int:
    """The group size the scales imply; ValueError if the kernel cannot apply them."""
    if not integer:
        raise ValueError(f"group scales apply to int8 / int4 weights, not {w.dtype=}")
    if group_scales.ndim != 2 or group_scales.shape[0] != n or k % group_scales.shape[1]:
        raise ValueError(f"{group_scales.shape=} must be [{n}, groups] with groups dividing {k=}")
    if group_scales.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise ValueError(f"{group_scales.dtype=} must be float32, bfloat16 or float16")
    group = k // group_scales.shape[1]
    if group * jax.dtypes.itemsize_bits(w.dtype) // 8 not in SWIZZLES:
        raise ValueError(
            f"a group of {group} {w.dtype} inputs must span 32, 64 or 128 bytes (one swizzled "
            "row of a pipeline block)"
        )
    return group


def skinny_matmul_fits(
    num_tokens: int, in_features: int, out_features: int, itemsize: float, group: int | None = None
) -> bool:
    """Whether the kernel takes this shape under its default tuning (whose splits always divide
    the contracted blocks). `itemsize`: the weight's bytes per element (0.5 for int4); `group`:
    the inputs per scale of a group-scaled weight."""
    if num_tokens % 8 or not 8 <= num_tokens <= MAX_TOKENS or out_features % ROWS:
        return False
    if group is not None:
        return group * itemsize in SWIZZLES and in_features % group == 0
    return in_features % int(ROW_BYTES / itemsize) == 0


@functools.partial(jax.jit, static_argnames=("w_layout", "tuning", "interpret"))
def skinny_matmul(
    x: jax.Array,  # [T, K]
    w: jax.Array,  # [N, K] (w_layout "out_in") or [K, N] ("in_out")
    group_scales: jax.Array | None = None,  # [N, K / group]: a scale per group of inputs
    *,
    w_layout: str,
    tuning: SkinnyTuning | None = None,
    interpret: bool | None = None,
) -> jax.Array:  # float32 [T, N]
    """x @ w^T (out_in) or x @ w (in_out) in float32, for T of 8 to 256 tokens (a multiple of 8):
    the weight is read once, split over enough CTAs to fill the GPU. bf16 / f16 x with a weight of
    the same type or an int8 / int4 weight (converted in registers), or fp8 x with an fp8 weight;
    8- and 4-bit weights stored out_in. Per-channel scales are the caller's (they apply after);
    `group_scales` ([N, groups], as the quantized layers store them) scale each group's partial
    product inside the kernel, a group spanning one 32-, 64- or 128-byte row of the weight
    (int4: 64, 128 or 256 inputs; int8: 32, 64 or 128). On CPU it runs in Mosaic GPU interpret
    mode."""
    if interpret is None:
        interpret = device_info.on_cpu()
    tn = check_inputs(
        x, w, group_scales, w_layout=w_layout, tuning=tuning, num_sms=_num_sms(interpret)
    )
    if group_scales is not None and (
        pad := -group_scales.shape[1] % scale_block(group_scales.dtype)
    ):
        # TMA reads the scales in 16-byte blocks of groups, and needs their rows' stride to be
        # whole blocks: layers whose group count is not (Qwen2.5-7B's down projection: 148 at
        # groups of 128) pay this pad per call. 8B and 1B shapes have none.
        group_scales = jnp.pad(group_scales, ((0, 0), (0, pad)))
    partials = launch(x, w, group_scales, w_layout=w_layout, tn=tn, interpret=interpret)
    return partials.sum(0).T


def _num_sms(interpret: bool) -> int:
    return INTERPRET_NUM_SMS if interpret else device_info.num_sms()
