"""Quantize / dequantize round trips on hand-made tensors, with exact expected values, and the
schemes' validation."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from nori_jax.quantization.quantize import dequantize_leaves, quantize_array, stored_bytes
from nori_jax.quantization.scheme import WeightQuantization, default_scheme


def _roundtrip(w: np.ndarray, scheme: WeightQuantization):
    leaves = quantize_array(jnp.asarray(w), scheme, jnp.float32)
    return (
        {k: np.asarray(v.astype(jnp.float32)) for k, v in leaves.items()},
        np.asarray(dequantize_leaves(leaves, scheme)),
        leaves,
    )


def test_int8_per_channel_exact_values():
    # Row 0: absmax 7.96875 = 127.5 / 16, so the scale is exactly 1/16; the absmax itself lands on
    # 127.5, rounds to 128 and clips to 127, its negative rounds to -128, which int8 holds (half a
    # step either way, like any other value).
    # Row 1: all zero -> scale 1, values 0. Row 2: absmax 127.5 -> scale 1, integers exact.
    w = np.array(
        [
            [7.96875, -1.0, 0.0625, 0.5, -7.96875, 3.03125, 0.0, 0.09375],
            [0.0] * 8,
            [127.5, -3.0, 2.0, 1.0, -100.0, 0.4, 0.6, -0.5],
        ],
        np.float32,
    )
    stored, back, leaves = _roundtrip(w, default_scheme("int8"))
    assert leaves["qvalue"].dtype == jnp.int8 and leaves["scale"].shape == (3, 1)
    np.testing.assert_array_equal(stored["scale"], [[1 / 16], [1.0], [1.0]])
    np.testing.assert_array_equal(
        stored["qvalue"],
        [
            [127, -16, 1, 8, -128, 48, 0, 2],  # 0.09375 * 16 = 1.5 rounds to even: 2
            [0] * 8,
            [127, -3, 2, 1, -100, 0, 1, 0],  # -0.5 rounds to even: 0
        ],
    )
    np.testing.assert_array_equal(back[0], [7.9375, -1.0, 0.0625, 0.5, -8.0, 3.0, 0.0, 0.125])
    np.testing.assert_array_equal(back[1], 0.0)


def test_int4_groups_of_128_exact_values():
    # Two groups per row. Group 0: absmax 1.875 = 7.5 * 0.25 -> scale 0.25; 1.875 rounds to 8 and
    # clips to 7, -1.875 rounds to -8, which int4 holds (dequantized: -2.0).
    # Group 1: absmax 3.75 -> scale 0.5. Row 1: an empty group (scale 1) and absmax 15 (scale 2).
    w = np.zeros((2, 256), np.float32)
    w[0, :4] = [1.875, -1.875, 0.3, -0.125]
    w[0, 128:131] = [3.75, 1.2, -0.25]
    w[1, 128:130] = [-15.0, 0.05]
    stored, back, leaves = _roundtrip(w, default_scheme("int4"))
    assert leaves["qvalue"].dtype == jnp.int4 and leaves["scale"].shape == (2, 2)
    np.testing.assert_array_equal(stored["scale"], [[0.25, 0.5], [1.0, 2.0]])
    np.testing.assert_array_equal(stored["qvalue"][0, :4], [7, -8, 1, 0])  # 0.3/0.25 = 1.2
    np.testing.assert_array_equal(stored["qvalue"][0, 128:131], [7, 2, 0])  # -0.5 -> 0 (even)
    np.testing.assert_array_equal(back[0, :4], [1.75, -2.0, 0.25, 0.0])
    np.testing.assert_array_equal(back[0, 128:131], [3.5, 1.0, 0.0])
    np.testing.assert_array_equal(stored["qvalue"][1, 128:130], [-8, 0])  # -7.5 rounds to -8
    np.testing.assert_array_equal(back[1, 128:130], [-16.0, 0.0])
    # every other value is zero and stays zero
    mask = np.ones_like(w, bool)
    mask[0, :4] = mask[0, 128:131] = mask[1, 128:130] = False
    np.testing.assert_array_equal(back[mask], 0.0)


def test_fp8_per_channel_exact_values():
    # absmax 56 = 448 / 8 -> scale 1/8; x / scale: 448 and 8 and -24 are e4m3 values, 2.4 rounds
    # to 2.5 (e4m3 steps by 0.25 between 2 and 4), 13 rounds to 13, 0.01 * 8 = 0.08 to 0.078125.
    w = np.array([[56.0, 1.0, -3.0, 0.3, 1.625, 0.01]], np.float32)
    stored, back, leaves = _roundtrip(w, default_scheme("fp8"))
    assert leaves["qvalue"].dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(stored["scale"], [[0.125]])
    np.testing.assert_array_equal(stored["qvalue"], [[448.0, 8.0, -24.0, 2.5, 13.0, 0.078125]])
    np.testing.assert_array_equal(back, [[56.0, 1.0, -3.0, 0.3125, 1.625, 0.009765625]])


@pytest.mark.parametrize("mode", ["fp8", "int8", "int4"])
def test_roundtrip_error_is_at_most_half_a_step(mode):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((16, 512)).astype(np.float32) * rng.uniform(0.1, 10, (16, 1))
    scheme = default_scheme(mode)
    stored, back, _ = _roundtrip(w, scheme)
    err = np.abs(back - w)
    if mode == "fp8":  # relative: 3 mantissa bits, half an ulp is 1/16 of the value
        scale = np.repeat(stored["scale"], 512, axis=1)
        assert np.all(err <= np.maximum(np.abs(w) / 16, scale * 2**-9 / 2) * (1 + 1e-6))
    else:
        group = 512 if scheme.group_size is None else scheme.group_size
        step = np.repeat(stored["scale"], group, axis=1)
        assert np.all(err <= step / 2 * (1 + 1e-5))  # float rounding of the scale
        assert err.max() > step.max() / 4  # a real quantization, not a copy


def test_stored_bytes_counts_int4_as_half_a_byte():
    leaves = quantize_array(jnp.ones((8, 256)), default_scheme("int4"), jnp.bfloat16)
    assert stored_bytes(leaves.values()) == 8 * 256 // 2 + 8 * 2 * 2


def test_scheme_validation_names_the_problem():
    with pytest.raises(ValueError, match="quantization='int5' must be one of"):
        default_scheme("int5")
    with pytest.raises(ValueError, match="offset per group exists only for group-wise int4"):
        WeightQuantization("int8", 32, offset=True)
    with pytest.raises(ValueError, match="fp8' scales whole output channels"):
        WeightQuantization("fp8", 128)
    with pytest.raises(ValueError, match="multiple of 128: mlp.down_proj has 576 inputs"):
        default_scheme("int4").check_in_features("mlp.down_proj", 576)
    with pytest.raises(ValueError, match="float weights are quantized symmetrically"):
        quantize_array(jnp.ones((2, 64)), WeightQuantization("int4", 32, offset=True), jnp.float32)
