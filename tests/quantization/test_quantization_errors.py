"""Unsupported quantization settings fail with a ValueError that names the setting and the layer."""

from __future__ import annotations

import argparse
import types

import jax.numpy as jnp
import pytest
from gguf.constants import GGMLQuantizationType as Q

from nori_jax import LLM
from nori_jax.engine_args import add_engine_args, engine_config_from_args
from nori_jax.engine_config import EngineConfig
from nori_jax.executor.mesh import make_mesh
from nori_jax.mesh_config import MeshConfig
from nori_jax.model_config import ModelConfig, load_preset
from nori_jax.quantization.scheme import WeightQuantization
from nori_jax.weights.loader import abstract_model, check_quantized_sharding, load_model
from tests.weights.tiny_gguf import write_tiny_gguf


def test_unknown_mode_is_refused_by_name():
    with pytest.raises(ValueError, match=r"quantization='int3' must be None or one of"):
        EngineConfig(quantization="int3")
    with pytest.raises(ValueError, match=r"quantization='nf4' must be None or one of"):
        LLM("tiny-llama", load_format="dummy", quantization="nf4")


def test_int4_needs_inputs_divisible_by_its_group():
    # tiny-llama's hidden size is 64: int4's groups of 128 do not fit its projections.
    with pytest.raises(
        ValueError, match=r"groups of 128 inputs .* self_attn.qkv_proj has 64 inputs \(64 % 128"
    ):
        load_model(
            "tiny-llama", load_format="dummy", quantization="int4", mesh=make_mesh(MeshConfig())
        )


def test_gguf_that_must_be_requantized_gets_the_same_check(tmp_path):
    path = tmp_path / "q5.gguf"
    write_tiny_gguf(path, qtype=Q.Q5_0)  # no 4-bit blocks to keep: int4 re-quantizes, groups of 128
    with pytest.raises(ValueError, match=r"multiple of 128: self_attn.qkv_proj has 64 inputs"):
        load_model(str(path), quantization="int4", mesh=make_mesh(MeshConfig()), param_cache=False)
    loaded = load_model(
        str(path), quantization="int8", mesh=make_mesh(MeshConfig()), param_cache=False
    )
    assert "quantized at load from GGUF Q5_0" in loaded.quantization.source


def test_groups_split_over_tensor_parallel_shards_are_refused():
    cfg = ModelConfig.from_hf_dict(load_preset("tiny-llama"))
    scheme = WeightQuantization("int4", 32, source="test")  # o_proj: 64 inputs, 2 groups
    _, abstract = abstract_model(cfg, jnp.float32, "reference", scheme)
    check_quantized_sharding(abstract, types.SimpleNamespace(shape={"model": 2}))
    with pytest.raises(ValueError, match=r"o_proj: 2 groups of 32 inputs cannot be split 4 ways"):
        check_quantized_sharding(abstract, types.SimpleNamespace(shape={"model": 4}))


def test_cli_flag_sets_the_config_field():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert (
        engine_config_from_args(parser.parse_args(["--quantization", "fp8"])).quantization == "fp8"
    )
    assert engine_config_from_args(parser.parse_args([])).quantization is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "int3"])
