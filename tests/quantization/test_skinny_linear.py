"""Quantized layers on the skinny-matmul kernel (quantized_matmul="pallas"): fp8 gives XLA's fp8
dot's output, int8 / int4 the dequantized product; chosen only where the kernel applies, and
refused where XLA must partition the dot."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nori_jax.engine import resolve_quantized_matmul
from nori_jax.engine_config import EngineConfig
from nori_jax.mesh_config import MeshConfig
from nori_jax.model_config import ModelConfig, load_preset
from nori_jax.models.linear import (
    COLUMN,
    QuantizedLinear,
    skinny_matmul_takes,
    use_small_matmul,
)
from nori_jax.models.llama import LlamaForCausalLM
from nori_jax.quantization.quantize import quantize_array
from nori_jax.quantization.scheme import WeightQuantization, default_scheme


def _layer(mode: str | WeightQuantization, k: int = 256, n: int = 384) -> QuantizedLinear:
    scheme = default_scheme(mode) if isinstance(mode, str) else mode
    layer = QuantizedLinear(k, n, jnp.bfloat16, COLUMN, scheme, "test")
    w = 0.05 * jax.random.normal(jax.random.key(1), (n, k))
    for name, value in quantize_array(w, scheme, scheme.scale_dtype(jnp.bfloat16)).items():
        getattr(layer, name).set_value(value)
    return layer


def test_kernel_gives_xla_fp8_output():
    layer = _layer("fp8")
    x = jax.random.normal(jax.random.key(2), (16, 256)).astype(jnp.bfloat16)
    x = x.at[3].set(0.0)  # a padding row: scale 1, output 0
    want = layer(x)
    use_small_matmul(layer, "pallas")
    assert layer.small_matmul == "pallas" and layer._skinny(16, x.dtype)
    got = layer(x)  # interpret mode on this CPU machine
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(got[3], np.float32), 0.0)


def test_int8_kernel_gives_the_scale_after_dot_output():
    """Per-channel int8 on the kernel: (x @ q) * scale in float32, then bf16: within bf16's
    rounding of the exact product (XLA's form rounds x @ q to bf16 before scaling: looser)."""
    layer = _layer("int8")
    x = jax.random.normal(jax.random.key(3), (16, 256)).astype(jnp.bfloat16)
    want = layer(x)
    use_small_matmul(layer, "pallas")
    got = layer(x)
    exact = x.astype(jnp.float32) @ layer.qvalue[...].astype(jnp.float32).T * layer.scale[...][:, 0]
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(exact), rtol=1e-2, atol=1e-3)
    np.testing.assert_allclose(
        np.asarray(want, np.float32), np.asarray(exact), rtol=3e-2, atol=3e-2
    )


@pytest.mark.parametrize(
    "scheme",
    [WeightQuantization("int4", group_size=128), WeightQuantization("int8", group_size=32)],
    ids=["int4-g128", "int8-g32"],
)
def test_group_scaled_kernel_gives_the_dequantized_product(scheme):
    """Group scales applied inside the kernel: each group's exact float32 product times its
    scale, summed; within bf16's rounding of the dequantized weight's product."""
    layer = _layer(scheme, k=512, n=256)
    x = jax.random.normal(jax.random.key(4), (16, 512)).astype(jnp.bfloat16)
    use_small_matmul(layer, "pallas")
    assert layer._skinny(16, x.dtype)
    got = layer(x)
    w = layer.qvalue[...].astype(jnp.float32) * jnp.repeat(
        layer.scale[...].astype(jnp.float32), scheme.group_size, axis=1
    )
    exact = x.astype(jnp.float32) @ w.T
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(exact), rtol=1e-2, atol=2e-3)


def test_kernel_is_chosen_by_mode_tokens_and_shape():
    fp8, int8 = _layer("fp8"), _layer("int8")
    use_small_matmul(fp8, "pallas")
    use_small_matmul(int8, "pallas")
    bf16 = jnp.bfloat16
    assert [fp8._skinny(t, bf16) for t in (8, 16, 64, 128, 136, 256, 12)] == [True] * 4 + [
        False
    ] * 3
    assert int8._skinny(16, bf16) and not int8._skinny(16, jnp.float32)  # 16-bit tokens only
    int4 = _layer("int4")  # groups of 128: the kernel scales each group's product
    use_small_matmul(int4, "pallas")
    assert int4._skinny(16, bf16) and not int4._skinny(16, jnp.float32)
    q4_0 = _layer(WeightQuantization("int4", group_size=32))  # a 16-byte group: no swizzle
    q4_1 = QuantizedLinear(  # GGUF Q4_1's offsets stay with XLA (shape only: never run)
        256, 384, bf16, COLUMN, WeightQuantization("int4", group_size=128, offset=True), "q4_1"
    )
    for layer in (q4_0, q4_1):
        use_small_matmul(layer, "pallas")
        assert not layer._skinny(16, bf16)
    odd = _layer("fp8", n=192)  # output features not a multiple of the kernel's 128 rows
    use_small_matmul(odd, "pallas")
    assert not odd._skinny(16, bf16)
    assert not _layer("fp8")._skinny(16, bf16)  # not asked for


def _pallas_layers(pallas: bool, mesh=None) -> int:
    cfg = ModelConfig.from_hf_dict(load_preset("tiny-llama"))
    small = "pallas" if pallas else "xla"
    model = nnx.eval_shape(
        lambda: LlamaForCausalLM(
            cfg, jnp.float32, nnx.Rngs(0), "reference", default_scheme("fp8"), mesh, small
        )
    )
    layers = nnx.iter_graph(model)
    return sum(isinstance(n, QuantizedLinear) and n.small_matmul == "pallas" for _, n in layers)


def test_model_marks_its_quantized_layers():
    assert (
        _pallas_layers(True) == 4 * ModelConfig.from_hf_dict(load_preset("tiny-llama")).num_layers
    )
    assert _pallas_layers(False) == 0


def test_refused_where_it_cannot_apply():
    with pytest.raises(
        ValueError, match=r"quantized_matmul='pallas' runs on one device per replica"
    ):
        EngineConfig(quantization="fp8", quantized_matmul="pallas", mesh=MeshConfig(model=2))
    # a switch with nothing to switch is refused, not ignored
    with pytest.raises(ValueError, match=r"quantization=None has none"):
        EngineConfig(quantization=None, quantized_matmul="pallas")
    assert EngineConfig(quantization="int4", quantized_matmul="pallas").quantized_matmul == "pallas"
    assert EngineConfig(quantization="fp8", quantized_matmul="pallas").quantized_matmul == "pallas"
    with pytest.raises(ValueError, match=r"quantized_matmul='cublas' must be one of"):
        EngineConfig(quantized_matmul="cublas")
    with pytest.raises(ValueError, match=r"small_matmul=.pallas. on a mesh of tp=2"):
        _pallas_layers(True, types.SimpleNamespace(shape={"model": 2}))


def test_modes_the_kernel_takes():
    """What the start-up log and nori:model_config_info report as "pallas": fp8 with any tokens,
    int8 / int4 with 16-bit tokens, never an offset layout."""
    bf16, f32 = jnp.bfloat16, jnp.float32
    assert skinny_matmul_takes(default_scheme("fp8"), f32)
    for mode in ("int8", "int4"):
        assert skinny_matmul_takes(default_scheme(mode), bf16)
        assert skinny_matmul_takes(default_scheme(mode), jnp.float16)
        assert not skinny_matmul_takes(default_scheme(mode), f32)
    q4_1 = WeightQuantization("int4", group_size=128, offset=True)
    assert not skinny_matmul_takes(q4_1, bf16)


@pytest.mark.parametrize(
    ("quantization", "tp", "backend", "want"),
    [
        ("int4", 1, "gpu", "pallas"),  # measured 1.47x XLA's int4 form on the 8B engine
        ("int4", 2, "gpu", "xla"),  # tensor parallelism partitions XLA's dots only
        ("int4", 1, "cpu", "xla"),  # the kernel only runs interpreted there
        ("fp8", 1, "gpu", "upcast"),  # 1.02-1.03x the fp8 GEMM on the 8B engine; kernel 0.98x
        ("fp8", 2, "gpu", "upcast"),  # XLA's dot: partitioned under tensor parallelism
        ("fp8", 1, "cpu", "upcast"),
        ("int8", 1, "gpu", "xla"),  # faster than the kernel at 64 sequences
        (None, 1, "gpu", "xla"),
    ],
)
def test_auto_choice_by_mode(monkeypatch, quantization, tp, backend, want):
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    config = EngineConfig(quantization=quantization, mesh=MeshConfig(model=tp))
    assert config.quantized_matmul == "auto"
    assert resolve_quantized_matmul(config) == want
    for chosen in ("xla", "pallas", "upcast") if quantization else ("xla",):
        if chosen == "pallas" and tp > 1:
            continue
        explicit = EngineConfig(quantization=quantization, quantized_matmul=chosen)
        assert resolve_quantized_matmul(explicit) == chosen
