"""Per-channel int8 in calls of few tokens applies the scale after the dot (linear.py); both forms
compute x @ dequantized weight."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nori_jax.models.linear import COLUMN, SCALE_AFTER_DOT_MAX_TOKENS, QuantizedLinear
from nori_jax.quantization import WeightQuantization, default_scheme
from nori_jax.quantization.quantize import quantize_array


def _layer(scheme, k=64, n=32):
    w = 0.1 * jax.random.normal(jax.random.key(1), (n, k), jnp.float32)
    layer = QuantizedLinear(k, n, jnp.float32, COLUMN, scheme, "w")
    for name, value in quantize_array(w, scheme, jnp.float32).items():
        getattr(layer, name).set_value(value)
    return layer


def _multiplies_after_dot(layer, x) -> bool:
    """Whether the traced call multiplies the dot's output (the scale after it)."""
    eqns = jax.make_jaxpr(layer)(x).jaxpr.eqns
    dots = [e for e in eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 1
    out = dots[0].outvars[0]
    return any(e.primitive.name == "mul" and out in e.invars for e in eqns)


@pytest.mark.parametrize("tokens", [1, SCALE_AFTER_DOT_MAX_TOKENS, SCALE_AFTER_DOT_MAX_TOKENS + 1])
@pytest.mark.parametrize(
    "scheme", [default_scheme("int8"), WeightQuantization("int8", 32)], ids=["channel", "g32"]
)
def test_scale_after_the_dot_only_for_per_channel_int8_in_small_calls(tokens, scheme):
    layer = _layer(scheme)
    x = jax.random.normal(jax.random.key(2), (tokens, 64), jnp.float32)
    after = scheme.group_size is None and tokens <= SCALE_AFTER_DOT_MAX_TOKENS
    assert _multiplies_after_dot(layer, x) == after
    expected = np.asarray(x) @ np.asarray(layer.weight()).T
    np.testing.assert_allclose(np.asarray(layer(x)), expected, rtol=1e-5, atol=1e-5)
