"""EngineConfig: one declaration of every setting, flat or nested keys, presets, backend defaults,
and max_model_len resolution (a preset's value is a cap, an explicit one is exact). No JAX needed
except where the backend is asked."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from nori_jax.core.scheduler_config import DEFAULT_MAX_MODEL_LEN, SchedulerConfig
from nori_jax.engine_config import EngineConfig, read_preset
from nori_jax.engine_defaults import CPU_PRESET, backend_preset, resolve_engine_config
from nori_jax.mesh_config import MeshConfig


def test_flat_and_nested_keys_build_the_same_config():
    flat = EngineConfig.from_dict({"max_num_seqs": 8, "page_size": 16, "mesh": {"model": 2}})
    nested = EngineConfig.from_dict({"scheduler": {"max_num_seqs": 8, "page_size": 16}})
    assert flat.scheduler == nested.scheduler == SchedulerConfig(max_num_seqs=8, page_size=16)
    assert flat.mesh == MeshConfig(model=2) and nested.mesh == MeshConfig()
    with_objects = EngineConfig.from_dict({"scheduler": SchedulerConfig(max_num_seqs=8)})
    assert with_objects.scheduler.max_num_seqs == 8


@pytest.mark.parametrize(
    "values, match",
    [
        ({"max_num_seq": 8}, r"unknown engine config keys \['max_num_seq'\]"),
        ({"scheduler": {"pages": 3}}, r"unknown scheduler keys \['pages'\]"),
        ({"max_num_seqs": 8, "scheduler": {"max_num_seqs": 4}}, "both flat"),
        ({"scheduler": 5}, "scheduler must be a mapping"),
        ({"max_num_seqs": 512, "max_num_batched_tokens": 256}, "max_num_batched_tokens=256"),
        ({"page_size": 48}, "page_size=48 must be a power of two"),
        ({"dtype": "int8"}, "dtype='int8'"),
        ({"num_scheduler_steps": 0}, "num_scheduler_steps=0 must be >= 1"),
        ({"num_scheduler_steps": 2**31}, r"num_scheduler_steps=2147483648 must be at most 64"),
        ({"multi_step_max_seqs": -1}, "multi_step_max_seqs=-1 must be >= 1"),
        # a value of the wrong type is named here, not deep inside the engine (or taken as True)
        ({"page_size": "16"}, "page_size='16' must be an integer"),
        ({"page_size": 16.0}, "page_size=16.0 must be an integer"),
        ({"max_num_seqs": 8.5}, "max_num_seqs=8.5 must be an integer"),
        ({"max_model_len": 100.5}, "max_model_len=100.5 must be an integer or none"),
        ({"num_pages": 64.7}, "num_pages=64.7 must be an integer or none"),
        ({"gpu_memory_utilization": "0.5"}, "gpu_memory_utilization='0.5' must be a number"),
        ({"enable_prefix_caching": "false"}, "enable_prefix_caching='false' must be true or false"),
        ({"async_scheduling": "no"}, "async_scheduling='no' must be true or false"),
        ({"max_num_seqs": True}, "max_num_seqs=True must be an integer"),
        ({"mesh": {"model": "2"}}, "mesh model='2' must be an integer"),
        # the data-parallel router's prefix-affinity bound (docs/mesh.md)
        (
            {"mesh": {"prefix_affinity_max_imbalance_tokens": -1}},
            "mesh prefix_affinity_max_imbalance_tokens=-1 must be an integer >= 0",
        ),
        (
            {"mesh": {"prefix_affinity_max_imbalance_tokens": 4096.0}},
            "mesh prefix_affinity_max_imbalance_tokens=4096.0 must be an integer",
        ),
        (
            {"mesh": {"prefix_affinity_max_imbalance_tokens": True}},
            "mesh prefix_affinity_max_imbalance_tokens=True must be an integer",
        ),
        (
            {"mesh": {"prefix_affinity_max_imbalance_tokens": "4096"}},
            "mesh prefix_affinity_max_imbalance_tokens='4096' must be an integer",
        ),
        ({"seed": -1}, r"seed=-1 must be in \[0, 2\*\*32\)"),
        ({"seed": 2**70}, "seed=1180591620717411303424 must be in"),
        ({"seed": "abc"}, "seed='abc' must be an integer"),
        ({"cpu_kv_cache_gib": -1.0}, "cpu_kv_cache_gib=-1.0 must be > 0"),
    ],
)
def test_bad_values_name_the_key(values, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig.from_dict(values)


def test_a_path_object_is_taken_as_its_path():
    config = EngineConfig.from_dict({"model": Path("/models/x.gguf"), "tokenizer": Path("tok")})
    assert config.model == "/models/x.gguf" and config.tokenizer == "tok"


def test_numpy_scalars_become_python_numbers():
    config = EngineConfig.from_dict({"max_num_seqs": np.int64(8), "kv_headroom": np.float32(0.5)})
    assert config.scheduler.max_num_seqs == 8 and type(config.scheduler.max_num_seqs) is int
    assert type(config.scheduler.kv_headroom) is float


def test_the_engine_defaults_are_the_schedulers_own():
    """Nothing is copied by hand: the engine's scheduler settings are SchedulerConfig's fields."""
    assert EngineConfig().scheduler == SchedulerConfig()
    assert SchedulerConfig().max_num_batched_tokens == 4096  # the throughput shapes


def test_long_prefill_threshold_zero_means_no_isolation():
    assert SchedulerConfig(long_prefill_threshold=0).long_prefill_threshold is None


def test_preset_values_then_overrides_flat_or_nested():
    cfg = EngineConfig.from_preset("tiny-cpu", {"max_num_seqs": 4, "max_num_waiting": None})
    raw = read_preset("tiny-cpu")
    assert cfg.model == raw["model"] and cfg.scheduler.page_size == raw["page_size"]
    assert cfg.scheduler.max_num_seqs == 4 and cfg.scheduler.max_num_waiting is None
    nested = EngineConfig.from_preset("tiny-cpu", {"scheduler": {"max_num_seqs": 4}})
    assert nested.scheduler.max_num_seqs == 4
    # from_yaml keeps its "None is not given" meaning
    assert EngineConfig.from_yaml("tiny-cpu", max_num_seqs=None).scheduler.max_num_seqs == 16


def test_a_presets_max_model_len_is_a_cap_an_explicit_one_is_not():
    preset = EngineConfig.from_preset("cpu", {}).scheduler
    assert preset.max_model_len == read_preset("cpu")["max_model_len"] == 2048
    assert preset.clamp_max_model_len
    assert preset.for_model(512).max_model_len == 512  # a 512-position model
    assert preset.for_model(100_000).max_model_len == 2048

    explicit = EngineConfig.from_preset("cpu", {"max_model_len": 2048}).scheduler
    assert not explicit.clamp_max_model_len
    with pytest.raises(ValueError, match="max_model_len=2048 exceeds the model's limit of 512"):
        explicit.for_model(512)
    with pytest.raises(ValueError, match="exceeds"):
        EngineConfig.from_dict({"max_model_len": 2048}).scheduler.for_model(512)


def test_unset_max_model_len_is_the_models_limit_up_to_the_default_cap():
    assert SchedulerConfig().for_model(512).max_model_len == 512
    assert SchedulerConfig().for_model(131072).max_model_len == DEFAULT_MAX_MODEL_LEN


def test_backend_defaults():
    assert backend_preset("cpu") == CPU_PRESET
    assert backend_preset("gpu") is None and backend_preset("tpu") is None
    # This suite runs on CPU: no preset named means the cpu preset, then the given values.
    cfg = resolve_engine_config(None, {"max_num_seqs": 4})
    expected = EngineConfig.from_preset(CPU_PRESET, {"max_num_seqs": 4})
    assert cfg == expected
    assert cfg.scheduler.max_num_batched_tokens == read_preset(CPU_PRESET)["max_num_batched_tokens"]
    # An explicit preset wins over the backend's.
    assert resolve_engine_config("tiny-cpu", {}) == EngineConfig.from_preset("tiny-cpu", {})


def test_every_preset_builds():
    from nori_jax.engine_config import preset_names

    for name in preset_names():
        assert dataclasses.is_dataclass(EngineConfig.from_preset(name, {}))


@pytest.mark.parametrize(
    "content, match",
    [
        (b"max_num_seqs: [1\n", r"not YAML \(line 2, column 1: expected ',' or ']'"),
        (b"max_num_seqs: 4\n\xe9: 1\n", r"not UTF-8 \(line 2: byte 0xe9"),
    ],
)
def test_a_broken_preset_file_is_an_error_naming_it(tmp_path, content, match):
    """A preset or mesh file that is not YAML or not UTF-8 is a ValueError naming the file and
    its line (PyYAML's own error named "<unicode string>", the decoder's no file at all, and the
    CLIs printed a traceback)."""
    path = tmp_path / "broken.yaml"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=rf"{path}: {match}"):
        read_preset(path)
    with pytest.raises(ValueError, match=rf"{path}: {match}"):
        MeshConfig.from_yaml(path)
