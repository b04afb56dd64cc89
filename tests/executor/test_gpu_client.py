"""The engine's choice of XLA GPU client: the environment variable JAX reads, which engines "auto"
gives TFRT, and the refusal of a choice that can no longer take effect."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from nori_jax.distributed_config import DistributedConfig
from nori_jax.engine import tfrt_measured
from nori_jax.engine_config import EngineConfig
from nori_jax.executor import gpu_client
from nori_jax.mesh_config import MeshConfig

ENV = "XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT"


def test_the_variable_is_read_as_jax_reads_it():
    assert gpu_client.in_effect({}) == "default"
    assert gpu_client.in_effect({ENV: "0"}) == "default"
    assert gpu_client.in_effect({ENV: "1"}) == "tfrt"
    assert gpu_client.in_effect({ENV: "2"}) == "tfrt"  # JAX: bool(int(value))
    with pytest.raises(ValueError, match=f"{ENV}='yes' must be an integer"):
        gpu_client.in_effect({ENV: "yes"})


def test_unknown_clients_are_refused_naming_the_value():
    with pytest.raises(ValueError, match="gpu_client='cuda' must be one of"):
        gpu_client.apply("cuda", measured=True)
    with pytest.raises(ValueError, match="gpu_client='cuda' must be one of"):
        EngineConfig(gpu_client="cuda")


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({}, True),
        ({"mesh": MeshConfig(model=2)}, False),
        ({"mesh": MeshConfig(data=2)}, False),
        ({"mesh": MeshConfig(prefill=1, decode=1)}, False),
        ({"distributed": DistributedConfig("127.0.0.1:1234", 2, 0)}, False),
        ({"quantization": "int8"}, False),
        ({"kv_cache_dtype": "fp8"}, False),
        ({"dtype": "float32"}, True),
    ],
)
def test_auto_takes_tfrt_only_for_the_engines_measured_under_it(changes, expected):
    assert tfrt_measured(EngineConfig(**changes), own_devices=False) is expected


def test_a_data_parallel_replicas_own_process_drives_one_gpu():
    config = EngineConfig(mesh=MeshConfig(data=2))
    assert tfrt_measured(config, own_devices=True)
    tp2 = EngineConfig(mesh=MeshConfig(model=2, data=2))
    assert not tfrt_measured(tp2, own_devices=True)


def test_after_jax_started_auto_keeps_what_it_has_and_a_choice_is_refused(monkeypatch):
    import jax

    jax.numpy.zeros(1).block_until_ready()  # this process's backends are up
    monkeypatch.delenv(ENV, raising=False)
    assert gpu_client.apply("auto", measured=True) == "default"  # too late: no change, no error
    assert ENV not in os.environ
    assert gpu_client.apply("default", measured=True) == "default"  # in effect: accepted
    with pytest.raises(RuntimeError, match=f"start the process with {ENV}=1"):
        gpu_client.apply("tfrt", measured=True)
    assert ENV not in os.environ
    monkeypatch.setenv(ENV, "1")  # the user's choice at process start stands
    assert gpu_client.apply("auto", measured=False) == "tfrt"
    with pytest.raises(RuntimeError, match=f"start the process with {ENV}=0"):
        gpu_client.apply("default", measured=True)


@pytest.mark.parametrize(
    "given, choice, measured, expected_env",
    [
        (None, "auto", True, "1"),
        (None, "auto", False, None),  # the default client: nothing to set
        ("0", "auto", True, "0"),  # the environment's choice stands
        (None, "tfrt", False, "1"),
        ("1", "default", True, "0"),
    ],
)
def test_apply_before_jax_sets_the_variable(given, choice, measured, expected_env):
    """In a fresh process: the choice lands in the environment before JAX starts, and JAX starts
    with it (on a CPU the variable changes nothing but must not break the start)."""
    code = (
        "import os\n"
        "from nori_jax.executor import gpu_client\n"
        f"print(gpu_client.apply({choice!r}, measured={measured}))\n"
        "import jax\n"
        f"print(float(jax.numpy.arange(4.0).sum()), os.environ.get({ENV!r}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != ENV} | {"JAX_PLATFORMS": "cpu"}
    if given is not None:
        env[ENV] = given
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    client = "tfrt" if expected_env not in (None, "0") else "default"
    assert out.stdout.split() == [client, "6.0", str(expected_env)]
