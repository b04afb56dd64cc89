"""QuantizedLinear's matmul against float32 computations on the dequantized values, and the
shardings its parameters carry."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from nori_jax.models.linear import COLUMN, MODEL, ROW, QuantizedLinear
from nori_jax.quantization.quantize import dequantize_leaves, quantize_array
from nori_jax.quantization.scheme import WeightQuantization, default_scheme
from nori_jax.weights.gguf_blocks import decode_blocks
from nori_jax.weights.gguf_quantized import blocks_to_tensor


def _linear(leaves, in_features, out_features, scheme, parallel=COLUMN) -> QuantizedLinear:
    layer = QuantizedLinear(in_features, out_features, jnp.float32, parallel, scheme, "test")
    for name, value in leaves.items():
        getattr(layer, name).set_value(jnp.asarray(value))
    return layer


def _data(t=5, k=256, n=48, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((t, k)).astype(np.float32)
    x[1] *= 40.0  # rows of very different ranges: per-token scales must follow each row
    x[2] = 0.0  # a padding row: scale 1, output 0, no NaN
    w = (rng.standard_normal((n, k)) * rng.uniform(0.01, 1.0, (n, 1))).astype(np.float32)
    return x, w


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_weight_only_matmul_is_the_float_matmul_of_the_dequantized_weight(mode):
    x, w = _data()
    scheme = default_scheme(mode)
    leaves = quantize_array(jnp.asarray(w), scheme, jnp.float32)
    y = np.asarray(jax.jit(lambda x: _linear(leaves, 256, 48, scheme)(x))(x))
    ref = x.astype(np.float64) @ np.asarray(dequantize_leaves(leaves, scheme), np.float64).T
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-4)
    assert np.abs(y - x @ w.T).max() > 1e-3  # and that is not the float matmul itself
    np.testing.assert_array_equal(y[2], 0.0)


def test_offset_layout_matmul_matches_gguf_values():
    import gguf
    from gguf.constants import GGMLQuantizationType as Q

    x, w = _data(k=128, n=16)
    raw = gguf.quants.quantize(w, Q.Q4_1)
    scheme = WeightQuantization("int4", 32, offset=True, source="test")
    t = blocks_to_tensor(decode_blocks(raw, Q.Q4_1), scheme)
    y = np.asarray(_linear(t.leaves(), 128, 16, scheme)(jnp.asarray(x)))
    ref = x.astype(np.float64) @ gguf.quants.dequantize(raw, Q.Q4_1).astype(np.float64).T
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-4)


def test_fp8_matmul_quantizes_each_token_and_multiplies_in_fp8():
    x, w = _data()
    scheme = default_scheme("fp8")
    leaves = quantize_array(jnp.asarray(w), scheme, jnp.float32)
    y = np.asarray(jax.jit(lambda x: _linear(leaves, 256, 48, scheme)(x))(x))
    # Reference written without qwix: per-row absmax / 448, rounded to e4m3 by ml_dtypes.
    absmax = np.abs(x).max(axis=1, keepdims=True)
    sx = np.where(absmax > 0, absmax / 448.0, 1.0).astype(np.float32)
    xq = (x / sx).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * sx
    ref = xq @ np.asarray(dequantize_leaves(leaves, scheme), np.float64).T
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-4)
    assert np.abs(ref - x @ np.asarray(dequantize_leaves(leaves, scheme)).T).max() > 1e-2
    np.testing.assert_array_equal(y[2], 0.0)


@pytest.mark.parametrize(
    ("scheme", "parallel", "scale_spec"),
    [
        (default_scheme("int8"), COLUMN, (MODEL, None)),
        (default_scheme("int8"), ROW, (None, None)),  # one scale column: nothing to split
        (default_scheme("int4"), COLUMN, (MODEL, None)),
        (default_scheme("int4"), ROW, (None, MODEL)),  # groups follow their input features
        (default_scheme("fp8"), ROW, (None, None)),
    ],
)
def test_parameters_keep_the_float_layouts_split(scheme, parallel, scale_spec):
    layer = nnx.eval_shape(lambda: QuantizedLinear(256, 512, jnp.bfloat16, parallel, scheme, "t"))
    specs = nnx.get_partition_spec(nnx.state(layer))
    q_spec = (MODEL, None) if parallel == COLUMN else (None, MODEL)  # [out, in]
    assert tuple(specs["qvalue"].get_value()) == q_spec
    assert tuple(specs["scale"].get_value()) == scale_spec
    assert layer.qvalue.get_value().shape == (512, 256)
    assert layer.scale.get_value().shape == (512, scheme.num_groups(256))
    assert layer.scale.get_value().dtype == (jnp.float32 if scheme.mode == "fp8" else jnp.bfloat16)
