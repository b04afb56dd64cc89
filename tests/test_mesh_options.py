"""Choosing a mesh: `--mesh NAME_OR_PATH` then per-field flags, `LLM(mesh=...)` as a preset, a
mapping or a MeshConfig, vLLM's tensor_parallel_size / data_parallel_size, `mesh:` in engine
presets, and the errors that name the value."""

from __future__ import annotations

import dataclasses

import pytest

from nori_jax import LLM
from nori_jax.cli import build_parser
from nori_jax.cli_parsing import walk_parsers
from nori_jax.engine_args import engine_overrides
from nori_jax.engine_config import EngineConfig
from nori_jax.mesh_config import MeshConfig, mesh_preset_names
from nori_jax.model_config import ModelConfig, load_preset

ENGINE_COMMANDS = ("generate", "chat", "serve", "run-batch", "bench offline", "plan calibrate")


def _mesh(**values) -> MeshConfig:
    return EngineConfig.from_dict(values).mesh


def test_every_preset_loads_and_names_its_devices():
    names = mesh_preset_names()
    assert {"tp2", "tp4", "tp8", "dp2", "dp2-tp4", "pd-1-1", "pd-2-2", "pd-2-6"} <= set(names)
    for name in names:
        assert MeshConfig.from_name(name).num_devices >= 1


def test_mesh_as_a_preset_a_mapping_or_a_mesh_config():
    assert _mesh(mesh="tp4") == MeshConfig(model=4)
    assert _mesh(mesh="dp2-tp4") == MeshConfig(model=4, data=2)
    assert _mesh(mesh={"model": 2}) == MeshConfig(model=2)
    assert _mesh(mesh=MeshConfig(prefill=1, decode=1)) == MeshConfig(prefill=1, decode=1)


def test_vllm_keywords_set_the_mesh_over_the_one_given():
    assert _mesh(tensor_parallel_size=2, data_parallel_size=4) == MeshConfig(model=2, data=4)
    assert _mesh(mesh="dp2-tp4", tensor_parallel_size=2) == MeshConfig(model=2, data=2)


def test_a_mesh_preset_path(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("model: 2\ndata: 3\n")
    assert _mesh(mesh=str(path)) == MeshConfig(model=2, data=3)


def test_an_engine_preset_may_name_its_mesh(tmp_path):
    path = tmp_path / "engine.yaml"
    path.write_text("max_num_seqs: 4\nmesh: tp2\n")
    assert EngineConfig.from_preset(path, {}).mesh == MeshConfig(model=2)
    # What the caller gives replaces the preset's mesh field by field.
    assert EngineConfig.from_preset(path, {"data_parallel_size": 2}).mesh == MeshConfig(
        model=2, data=2
    )
    assert EngineConfig.from_preset(path, {"mesh": "dp2"}).mesh == MeshConfig(data=2)


def _args(*argv: str):
    return build_parser().parse_args(["generate", "--prompt", "x", *argv])


def test_cli_mesh_then_field_flags():
    given = engine_overrides(_args("--mesh", "dp2-tp4", "--tensor-parallel-size", "2"))
    assert EngineConfig.from_dict(given).mesh == MeshConfig(model=2, data=2)
    assert EngineConfig.from_dict(engine_overrides(_args("--mesh", "pd-1-1"))).mesh == MeshConfig(
        prefill=1, decode=1
    )
    assert "mesh" not in engine_overrides(_args())  # unset: the preset's mesh decides


def test_the_prefix_affinity_bound_is_a_mesh_flag_over_a_preset():
    assert MeshConfig().prefix_affinity_max_imbalance_tokens == 4096
    argv = ("--mesh", "dp2", "--prefix-affinity-max-imbalance-tokens", "0")
    assert EngineConfig.from_dict(engine_overrides(_args(*argv))).mesh == MeshConfig(
        data=2, prefix_affinity_max_imbalance_tokens=0
    )
    assert _mesh(mesh={"data": 2, "prefix_affinity_max_imbalance_tokens": 100}) == MeshConfig(
        data=2, prefix_affinity_max_imbalance_tokens=100
    )


def test_every_engine_command_takes_mesh_and_the_parallel_sizes():
    commands = {" ".join(path): parser for path, parser in walk_parsers(build_parser())}
    for name in ENGINE_COMMANDS:
        flags = {s for a in commands[name]._actions for s in a.option_strings}
        assert {"--mesh", "--tensor-parallel-size", "--data-parallel-size"} <= flags, name
        assert "--prefix-affinity-max-imbalance-tokens" in flags, name


def test_cli_unknown_mesh_is_a_usage_error_naming_it(capsys):
    with pytest.raises(SystemExit) as e:
        _args("--mesh", "tp3")
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--mesh" in err and "'tp3'" in err and "tp4" in err  # lists the presets


@pytest.mark.parametrize(
    ("values", "match"),
    [
        ({"mesh": "tp3"}, r"mesh 'tp3' not found .*tp4"),
        ({"tensor_parallel_size": 0}, r"mesh model=0 must be an integer >= 1"),
        ({"mesh": 4}, r"mesh must be a mapping, got 4"),
        ({"mesh": {"modle": 2}}, r"unknown mesh keys \['modle'\]"),
    ],
)
def test_bad_meshes_name_the_value(values, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig.from_dict(values)


def test_a_mesh_larger_than_the_devices_names_both():
    # This process has one CPU device (the 8-device meshes run in subprocesses).
    with pytest.raises(ValueError, match=r"tp8 \(model=8.*needs 8 devices; 1 available \(cpu\)"):
        LLM("tiny-llama", load_format="dummy", mesh="tp8")


def test_tensor_parallel_size_must_fit_the_heads():
    cfg = ModelConfig.from_hf_dict(load_preset("tiny-llama"))  # 4 q heads, 2 kv heads
    MeshConfig(model=2).check_model(cfg)
    MeshConfig(model=4).check_model(cfg)  # kv heads replicated: each on 2 devices
    with pytest.raises(ValueError, match=r"model=8\) does not divide the model's num_heads=4"):
        MeshConfig(model=8).check_model(cfg)
    with pytest.raises(ValueError, match=r"model=3\) does not divide the model's num_heads=4"):
        MeshConfig(model=3).check_model(cfg)
    odd = dataclasses.replace(cfg, num_heads=12, num_kv_heads=3)
    with pytest.raises(ValueError, match=r"model=2\) and the model's num_kv_heads=3: one must"):
        MeshConfig(model=2).check_model(odd)
    assert MeshConfig(model=4).kv_heads(cfg) == 4 and MeshConfig(model=2).kv_heads(cfg) == 2
    assert MeshConfig(model=1).kv_heads(cfg) == 2
