"""The multi-host settings: flags on the commands, nested in EngineConfig, bad values refused."""

from __future__ import annotations

import pytest

from nori_jax.cli import build_parser
from nori_jax.distributed_config import DistributedConfig
from nori_jax.engine_args import engine_overrides
from nori_jax.engine_config import EngineConfig

FLAGS = ["--coordinator-address", "10.0.0.1:8476", "--num-processes", "2", "--process-id", "1"]


@pytest.mark.parametrize("command", [["generate", "--prompt", "x"], ["serve"]])
def test_the_flags_land_in_the_nested_config(command):
    given = engine_overrides(build_parser().parse_args([*command, *FLAGS]))
    assert given == {
        "distributed": {
            "coordinator_address": "10.0.0.1:8476",
            "num_processes": 2,
            "process_id": 1,
        }
    }
    config = EngineConfig.from_dict(given).distributed
    assert config.enabled and not config.is_leader and config.coordinator_host == "10.0.0.1"


def test_a_single_process_is_the_default():
    config = EngineConfig().distributed
    assert not config.enabled and config.is_leader


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (dict(num_processes=2), "coordinator_address=None must be HOST:PORT"),
        (dict(num_processes=2, coordinator_address="10.0.0.1"), "must be HOST:PORT"),
        (dict(num_processes=2, coordinator_address="h:99999"), "must be HOST:PORT"),
        (dict(num_processes=2, process_id=2, coordinator_address="h:1"), "process_id=2 must be <"),
        (dict(num_processes=0), "num_processes=0 must be an integer >= 1"),
        (dict(process_id=-1), "process_id=-1 must be an integer >= 0"),
        (dict(step_timeout_s=0), "step_timeout_s=0 must be > 0"),
    ],
)
def test_bad_values_are_value_errors_naming_them(values, message):
    with pytest.raises(ValueError, match=message):
        DistributedConfig(**values)


def test_a_multi_host_engine_is_one_replica():
    from nori_jax.engine import build_engine
    from nori_jax.mesh_config import MeshConfig

    config = EngineConfig(
        mesh=MeshConfig(data=2),
        distributed=DistributedConfig(coordinator_address="127.0.0.1:1", num_processes=2),
    )
    with pytest.raises(ValueError, match="a multi-host engine is one replica"):
        build_engine(config)


def test_a_follower_is_not_an_engine_of_its_own():
    from nori_jax.engine import LLMEngine

    dist = DistributedConfig(coordinator_address="127.0.0.1:1", num_processes=2, process_id=1)
    with pytest.raises(ValueError, match="process_id=1 is a follower"):
        LLMEngine(EngineConfig(distributed=dist))
