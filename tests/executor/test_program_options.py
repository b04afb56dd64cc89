"""Per-program XLA options (program_options.py): fp8 weights compile with Triton GEMM off, the
other modes with XLA's defaults, and a user's own XLA_FLAGS setting stands."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from nori_jax.executor import program_options
from nori_jax.quantization import default_scheme

OFF = {program_options.TRITON_GEMM: False}


@pytest.mark.parametrize("mode, options", [(None, {}), ("int8", {}), ("int4", {}), ("fp8", OFF)])
def test_options_by_weight_mode(mode, options):
    scheme = None if mode is None else default_scheme(mode)
    assert program_options.for_weights(scheme, xla_flags="") == options


def test_fp8_forward_passes_of_few_tokens_keep_triton_when_upcast():
    """quantized_matmul="upcast": a forward pass of at most 64 tokens holds no fp8 dot (its fp8
    layers are weight-only), so it keeps the Triton fusions that convert the weight in the GEMM;
    larger buckets and every other program still turn them off."""
    fp8 = default_scheme("fp8")

    def options(bucket, small="upcast"):
        return program_options.for_weights(fp8, xla_flags="", bucket=bucket, small_matmul=small)

    assert options(16) == options(64) == {}
    assert options(128) == options(None) == OFF
    assert options(16, "xla") == options(16, "pallas") == OFF
    int8 = program_options.for_weights(
        default_scheme("int8"), xla_flags="", bucket=16, small_matmul="upcast"
    )
    assert int8 == {}


@pytest.mark.parametrize(
    "flags", ["--xla_gpu_enable_triton_gemm=true", "--foo=1 --xla_gpu_enable_triton_gemm=false"]
)
def test_a_users_xla_flags_setting_stands(flags):
    assert program_options.for_weights(default_scheme("fp8"), xla_flags=flags) == {}
    assert program_options.user_sets(program_options.TRITON_GEMM, flags)
    # a flag whose name only starts with the option's is another flag
    assert not program_options.user_sets("xla_gpu_enable_triton", flags)


def test_xla_accepts_the_options():
    """XLA refuses an option it does not know (INVALID_ARGUMENT), so a renamed flag fails here."""
    lowered = jax.jit(lambda x: x @ x).lower(jnp.ones((4, 4)))
    out = lowered.compile(compiler_options=OFF)(jnp.ones((4, 4)))
    assert float(out[0, 0]) == 4.0


@pytest.mark.parametrize("mode", [None, "fp8"])
def test_kv_scale_calibration_compiles_with_the_engines_options(mode, monkeypatch):
    """The calibration prefill runs the model outside the runner: it takes the same options."""
    from nori_jax.executor.kv_calibration import calibration_token_ids, measure_kv_scales
    from nori_jax.executor.mesh import make_mesh
    from nori_jax.mesh_config import MeshConfig
    from nori_jax.weights.loader import load_model

    seen = []
    compile_ = jax.stages.Lowered.compile

    def spy(self, *args, compiler_options=None, **kwargs):
        seen.append(compiler_options)
        return compile_(self, *args, compiler_options=compiler_options, **kwargs)

    monkeypatch.setattr(jax.stages.Lowered, "compile", spy)
    mesh = make_mesh(MeshConfig())
    loaded = load_model(
        "tiny-llama", load_format="dummy", mesh=mesh, param_cache=False, quantization=mode
    )
    scales = measure_kv_scales(loaded, mesh, jnp.float8_e4m3fn, calibration_token_ids(loaded, 32))
    assert scales.shape == (loaded.config.num_layers, 2)
    assert seen == [OFF if mode == "fp8" else {}]
