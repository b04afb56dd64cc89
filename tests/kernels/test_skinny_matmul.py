"""The skinny matmul (pallas_kernels/skinny_matmul) in Mosaic GPU interpret mode against its
float32 reference, its input errors, its tuning, and its CUDA lowering at the 8B shapes.

The cases cover each weight layout and operand type, one and several splits of the contracted
axis, two and three pipeline stages, and token counts of one and of two epilogue chunks (more
than 32 tokens store their partial sums in two passes)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import device_info
from pallas_kernels.skinny_matmul import (
    SkinnyTuning,
    default_tuning,
    skinny_matmul,
    skinny_matmul_fits,
    skinny_matmul_reference,
)

FP8 = jnp.float8_e4m3fn


def _operands(layout, dtype, t, k, n, seed=0, w_dtype=None):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (t, k), jnp.float32).astype(dtype)
    w_shape = (n, k) if layout == "out_in" else (k, n)
    if w_dtype == jnp.int8:
        return x, jax.random.randint(kw, w_shape, -127, 128).astype(jnp.int8)
    if w_dtype == jnp.int4:  # every value of the type, -8 included
        return x, jax.random.randint(kw, w_shape, -8, 8).astype(jnp.int8).astype(jnp.int4)
    return x, jax.random.normal(kw, w_shape, jnp.float32).astype(dtype)


def _group_scales(k, n, group, seed=5):
    """[n, k / group] scales of both signs and several magnitudes, in bf16 (the compute dtype)."""
    s = jax.random.uniform(jax.random.key(seed), (n, k // group), jnp.float32, -2.0, 2.0)
    return s.astype(jnp.bfloat16)


@pytest.mark.parametrize(
    "layout, dtype, t, k, n, tuning, w_dtype",
    [
        ("in_out", jnp.bfloat16, 16, 256, 256, SkinnyTuning(64, 2, 2), None),  # kernel [in, out]
        ("out_in", jnp.bfloat16, 8, 128, 128, SkinnyTuning(64, 2, 1), None),
        ("out_in", jnp.float16, 24, 384, 128, SkinnyTuning(64, 3, 3), None),
        ("out_in", FP8, 64, 512, 256, SkinnyTuning(128, 2, 2), None),  # two epilogue chunks
        ("out_in", jnp.float8_e5m2, 40, 256, 128, SkinnyTuning(128, 2, 1), None),
        ("out_in", jnp.bfloat16, 16, 512, 128, SkinnyTuning(128, 2, 2), jnp.int8),
        ("out_in", jnp.bfloat16, 24, 512, 128, SkinnyTuning(256, 2, 1), jnp.int4),
    ],
    ids=[
        "bf16-in_out-splits2",
        "bf16-out_in-8tok",
        "f16-3stages-3splits",
        "e4m3-64tok",
        "e5m2",
        "int8-weight-bf16-x",
        "int4-weight-per-channel",
    ],
)
def test_kernel_matches_reference(layout, dtype, t, k, n, tuning, w_dtype):
    x, w = _operands(layout, dtype, t, k, n, w_dtype=w_dtype)
    got = skinny_matmul(x, w, w_layout=layout, tuning=tuning, interpret=True)
    want = skinny_matmul_reference(x, w, w_layout=layout)
    assert got.shape == (t, n) and got.dtype == jnp.float32
    # products of 16- and 8-bit values are exact in float32; only the order of the sums differs
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(
    "w_dtype, x_dtype, t, k, n, group, tuning",
    [
        (jnp.int4, jnp.bfloat16, 16, 512, 256, 128, SkinnyTuning(128, 2, 2)),  # 4 groups, padded
        (jnp.int4, jnp.float16, 48, 512, 128, 256, SkinnyTuning(256, 3, 1)),  # 2 epilogue passes
        (jnp.int8, jnp.bfloat16, 8, 256, 128, 32, SkinnyTuning(32, 2, 2)),  # GGUF Q8_0's blocks
        (jnp.int4, jnp.bfloat16, 16, 3072, 128, 128, SkinnyTuning(128, 2, 2)),  # 8-group boxes
        (jnp.int4, jnp.bfloat16, 16, 1024, 128, 128, None),  # the default tuning
    ],
    ids=[
        "int4-g128-splits2",
        "int4-g256-f16-48tok",
        "int8-g32",
        "int4-g128-boxes-across-splits",
        "int4-g128-default",
    ],
)
def test_group_scales_match_reference(w_dtype, x_dtype, t, k, n, group, tuning):
    """Each group's product scaled inside the kernel, against the reference on the dequantized
    weight (float32 sums in another order, then scaled: a few float32 roundings apart)."""
    x, w = _operands("out_in", x_dtype, t, k, n, seed=2, w_dtype=w_dtype)
    scales = _group_scales(k, n, group)
    got = skinny_matmul(x, w, scales, w_layout="out_in", tuning=tuning, interpret=True)
    want = skinny_matmul_reference(x, w, scales, w_layout="out_in")
    assert got.shape == (t, n) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-3)


def test_default_tuning_runs_in_interpret_mode():
    """The tuning the API picks by itself (few SMs in interpret mode: splits still > 1)."""
    x, w = _operands("out_in", FP8, 16, 1024, 128, seed=1)
    tn = default_tuning(16, 1024, 128, 1, num_sms=2)
    assert tn.splits > 1
    got = skinny_matmul(x, w, w_layout="out_in")
    np.testing.assert_allclose(
        np.asarray(got), np.asarray(skinny_matmul_reference(x, w, w_layout="out_in")), rtol=1e-5
    )


@pytest.mark.parametrize(
    "x_shape, w_shape, layout, dtype, w_dtype, tuning, match",
    [
        ((12, 128), (128, 128), "out_in", jnp.bfloat16, None, None, "num_tokens=12"),
        ((264, 128), (128, 128), "out_in", jnp.bfloat16, None, None, "num_tokens=264"),
        ((16, 128), (192, 128), "out_in", jnp.bfloat16, None, None, "n=192"),
        ((16, 128), (128, 256), "out_in", jnp.bfloat16, None, None, "contract different"),
        ((16, 128), (128, 128), "in_out", FP8, None, None, "stored out_in"),
        ((16, 128), (128, 128), "in_out", jnp.bfloat16, jnp.int8, None, "stored out_in"),
        ((16, 128), (128, 128), "out_in", FP8, jnp.bfloat16, None, "both be fp8"),
        ((16, 128), (128, 128), "out_in", FP8, jnp.int8, None, "both be fp8"),
        ((16, 128), (128, 128), "out_in", jnp.float32, None, None, "x.dtype"),
        ((16, 128), (128, 128), "rows", jnp.bfloat16, None, None, "w_layout='rows'"),
        ((16, 384), (128, 384), "out_in", jnp.bfloat16, None, SkinnyTuning(64, 2, 4), "k=384"),
        ((16, 128), (128, 128), "out_in", FP8, jnp.int4, None, "int8 or int4"),
    ],
)
def test_input_errors(x_shape, w_shape, layout, dtype, w_dtype, tuning, match):
    x = jnp.zeros(x_shape, dtype)
    w = jnp.zeros(w_shape, w_dtype or dtype)
    with pytest.raises(ValueError, match=match):
        skinny_matmul(x, w, w_layout=layout, tuning=tuning)


@pytest.mark.parametrize(
    "w_dtype, scales_shape, tuning, match",
    [
        (FP8, (128, 2), None, "apply to int8 / int4"),
        (jnp.int4, (128, 8), None, "32, 64 or 128 bytes"),  # groups of 32 int4: 16 bytes
        (jnp.int4, (256, 2), None, "must be \\[128, groups\\]"),
        (jnp.int4, (128, 3), None, "groups dividing"),
        (jnp.int4, (128, 2), SkinnyTuning(256, 2, 1), "block_k must be the scales' group"),
    ],
)
def test_group_scale_errors(w_dtype, scales_shape, tuning, match):
    x_dtype = FP8 if w_dtype == FP8 else jnp.bfloat16
    x, w = jnp.zeros((16, 256), x_dtype), jnp.zeros((128, 256), w_dtype)
    with pytest.raises(ValueError, match=match):
        skinny_matmul(x, w, jnp.ones(scales_shape, jnp.bfloat16), w_layout="out_in", tuning=tuning)


@pytest.mark.parametrize(
    "t, k, n, itemsize",
    [(16, 4096, 28672, 1), (16, 14336, 4096, 1), (128, 4096, 6144, 2), (256, 14336, 4096, 2)],
)
def test_default_tuning(t, k, n, itemsize):
    """Splits divide the contracted blocks and keep the partial sums under a quarter of the
    weight's bytes; stages fit the CTA's shared memory budget."""
    tn = default_tuning(t, k, n, itemsize, num_sms=132)
    assert tn.block_k * itemsize == 128
    assert k % (tn.block_k * tn.splits) == 0
    assert tn.splits * t * 4 * 4 <= k * itemsize or tn.splits == 1
    assert 2 <= tn.stages <= 6
    assert skinny_matmul_fits(t, k, n, itemsize)
    assert not skinny_matmul_fits(t + 4, k, n, itemsize)


@pytest.mark.parametrize(
    "layout, dtype, t, k, n",
    [
        ("out_in", FP8, 16, 4096, 28672),
        ("out_in", FP8, 128, 14336, 4096),
        ("in_out", jnp.bfloat16, 64, 4096, 6144),
    ],  # fmt: skip
)
def test_lowers_for_cuda(monkeypatch, layout, dtype, t, k, n):
    """The 8B layer shapes under the default tuning lower for CUDA on this CPU machine (Mosaic
    GPU's lowering runs in Python; only the PTX compile needs the GPU)."""
    monkeypatch.setattr(device_info, "on_cpu", lambda: False)
    w_shape = (n, k) if layout == "out_in" else (k, n)
    traced = jax.jit(lambda x, w: skinny_matmul(x, w, w_layout=layout)).trace(
        jax.ShapeDtypeStruct((t, k), dtype), jax.ShapeDtypeStruct(w_shape, dtype)
    )
    assert "mosaic_gpu" in traced.lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize(
    "w_dtype, group, t, k, n",
    [
        (jnp.int4, 128, 16, 4096, 6144),  # qkv, int4's default groups
        (jnp.int4, 128, 128, 14336, 4096),  # down, two epilogue passes
        (jnp.int8, 32, 64, 4096, 28672),  # gate/up, GGUF Q8_0's blocks
        (jnp.int8, None, 16, 4096, 4096),  # o, per-channel int8 (no scales in the kernel)
    ],  # fmt: skip
)
def test_integer_weights_lower_for_cuda(monkeypatch, w_dtype, group, t, k, n):
    """The weight converted in registers (and the group scales' per-row broadcast) at the 8B
    shapes: Mosaic GPU's layout inference and lowering run here, before any PTX."""
    monkeypatch.setattr(device_info, "on_cpu", lambda: False)
    scales = None if group is None else jax.ShapeDtypeStruct((n, k // group), jnp.bfloat16)
    traced = jax.jit(lambda x, w, s: skinny_matmul(x, w, s, w_layout="out_in")).trace(
        jax.ShapeDtypeStruct((t, k), jnp.bfloat16), jax.ShapeDtypeStruct((n, k), w_dtype), scales
    )
    assert "mosaic_gpu" in traced.lower(lowering_platforms=("cuda",)).as_text()
