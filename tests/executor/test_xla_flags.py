"""The engine's XLA:GPU settings: XLA_FLAGS composition, the refusal once JAX has started, and the
KV pool's budget under the VMM allocator that `command_buffer_update="skip_temp"` brings."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import numpy as np
import pytest

from nori_jax.engine_config import EngineConfig
from nori_jax.executor import kv_cache, xla_flags
from nori_jax.model_config import ModelConfig, load_preset

FLAG = "--xla_gpu_command_buffer_update_mode"


def test_update_mode_replaces_an_earlier_setting_and_keeps_other_flags():
    given = f"--xla_gpu_autotune_level=0 {FLAG}=ALWAYS_UPDATE --xla_dump_to=/tmp/x"
    out = xla_flags.with_update_mode(given, "skip_temp")
    assert out.split() == [
        "--xla_gpu_autotune_level=0",
        "--xla_dump_to=/tmp/x",
        f"{FLAG}=SKIP_TEMP",
    ]
    assert xla_flags.with_update_mode(out, "always").split() == out.split()[:2]
    assert xla_flags.flag_in(out) == "SKIP_TEMP"
    # a mode by XLA's own name (benchmarks ask about SKIP_PROFILED, no engine mode)
    profiled = xla_flags.with_update_value(out, "SKIP_PROFILED")
    assert profiled.split() == [*out.split()[:2], f"{FLAG}=SKIP_PROFILED"]
    assert xla_flags.with_update_value(profiled, None).split() == out.split()[:2]
    assert xla_flags.flag_in("--xla_dump_to=/tmp/x") is None


@pytest.mark.parametrize(
    "flags, mode, expected",
    [
        ("", "always", True),
        (f"{FLAG}=ALWAYS_UPDATE", "always", True),
        (f"{FLAG}=SKIP_TEMP", "always", False),
        ("", "skip_temp", False),
        (f"{FLAG}=SKIP_TEMP", "skip_temp", True),
        (f"{FLAG}=SKIP_TEMP {FLAG}=ALWAYS_UPDATE", "skip_temp", False),  # XLA takes the last
    ],
)
def test_in_effect_reads_the_last_setting(flags, mode, expected):
    assert xla_flags.in_effect(mode, flags) is expected


def test_unknown_modes_are_refused_naming_the_value():
    with pytest.raises(ValueError, match="command_buffer_update='never'"):
        xla_flags.apply("never")
    with pytest.raises(ValueError, match="command_buffer_update='never'"):
        EngineConfig(command_buffer_update="never")


def test_apply_after_jax_started_refuses_instead_of_doing_nothing(monkeypatch):
    import jax

    jax.numpy.zeros(1).block_until_ready()  # this process's backends are up
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    xla_flags.apply("always")  # XLA's default: nothing to change, nothing refused
    with pytest.raises(RuntimeError, match="before this process starts using JAX"):
        xla_flags.apply("skip_temp")
    assert "XLA_FLAGS" not in os.environ
    monkeypatch.setenv("XLA_FLAGS", f"{FLAG}=SKIP_TEMP")
    assert xla_flags.apply("skip_temp") == "skip_temp"  # already in effect: accepted


def test_auto_keeps_what_a_started_process_or_the_user_chose(monkeypatch):
    import jax

    jax.numpy.zeros(1).block_until_ready()
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    assert xla_flags.apply("auto") == "always"  # too late for skip_temp: no error, no change
    assert "XLA_FLAGS" not in os.environ
    for given, mode in (("SKIP_TEMP", "skip_temp"), ("ALWAYS_UPDATE", "always")):
        monkeypatch.setenv("XLA_FLAGS", f"{FLAG}={given}")
        assert xla_flags.apply("auto") == mode
        assert os.environ["XLA_FLAGS"] == f"{FLAG}={given}"


def test_apply_before_jax_reaches_xla(tmp_path):
    """In a fresh process: the engine's setting ("auto": skip_temp) lands in XLA_FLAGS and XLA
    accepts the flag (an unknown flag or value would abort the process when JAX starts its
    backend)."""
    code = (
        "import os\n"
        "from nori_jax.executor import xla_flags\n"
        "print(xla_flags.apply('auto'))\n"
        "import jax\n"
        "print(float(jax.numpy.arange(4.0).sum()), os.environ['XLA_FLAGS'])\n"
    )
    env = {**os.environ, "XLA_FLAGS": "--xla_cpu_enable_fast_math=false", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [
        "skip_temp",
        "6.0",
        "--xla_cpu_enable_fast_math=false",
        f"{FLAG}=SKIP_TEMP",
    ]


def _gpu_mesh(stats: dict[str, int], tp: int = 1):
    device = types.SimpleNamespace(
        platform="gpu", process_index=0, local_hardware_id=0, memory_stats=lambda: stats
    )
    return types.SimpleNamespace(devices=np.array([device] * tp), shape={"model": tp})


def test_kv_budget_under_the_vmm_allocator_comes_from_the_device_memory(monkeypatch):
    """The VMM allocator reports no statistics (memory_stats() is None on the H200; a partial
    report, here 1.5 GB mapped, is not the limit either): the budget is the device's memory x
    JAX's fraction instead, less at least the weights' share of the device. (The engine of
    e51e2a4 took the CPU branch on the H200 and sized the 135M shape's pool at 728 pages.)"""
    cfg = ModelConfig.from_hf_dict(load_preset("smollm2-135m"))
    per_page = kv_cache.bytes_per_page(cfg, 64, "bfloat16")
    stats = {"bytes_limit": 1_500_000_000, "bytes_in_use": 0}
    total = 150_000_000_000
    monkeypatch.setattr(xla_flags, "cuda_total_memory", lambda ordinal: total)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    weights = 300_000_000

    def pages(mesh):
        return kv_cache.num_pages_for_memory(cfg, 64, "bfloat16", mesh, 0.9, 1.0, weights)

    monkeypatch.setenv("XLA_FLAGS", f"{FLAG}=SKIP_TEMP")
    assert pages(_gpu_mesh(None)) == int((total * 0.75 * 0.9 - weights) // per_page)
    assert pages(_gpu_mesh(stats)) == int((total * 0.75 * 0.9 - weights) // per_page)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
    assert pages(_gpu_mesh(stats)) == int((total * 0.5 * 0.9 - weights) // per_page)
    # Under the default allocator its own statistics decide, as before.
    monkeypatch.setenv("XLA_FLAGS", "")
    assert pages(_gpu_mesh(stats)) == int((1_500_000_000 * 0.9) // per_page)


def test_setting_reads_a_flags_last_value():
    flags = "--a=1 --xla_b=x -xla_b=y --xla_bool --xla_bc=2"
    assert xla_flags.setting(flags, "xla_b") == "y"  # the last setting, one dash or two
    assert xla_flags.setting(flags, "xla_bool") == "true"  # a bare boolean flag
    assert xla_flags.setting(flags, "xla") is None  # a prefix of a name is another flag
    assert xla_flags.setting("", "xla_b") is None
