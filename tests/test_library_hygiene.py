"""Importing the library changes no global JAX state, and an engine counts only its own compiles.

JAX research teams import the engine into their own programs: its compile counter must not blame
the engine for their compiles, and the persistent compilation cache they configured must stay
theirs.
"""

from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from nori_jax import LLM, SamplingParams

SNAPSHOT = """
import jax
from jax._src import monitoring
def state():
    return (
        jax.config.jax_compilation_cache_dir,
        jax.config.jax_persistent_cache_min_compile_time_secs,
        jax.config.jax_persistent_cache_min_entry_size_bytes,
        len(monitoring._event_duration_secs_listeners),
        len(monitoring._event_listeners),
    )
before = state()
import nori_jax, nori_jax.engine, nori_jax.llm, nori_jax.core_client, serve.api
from nori_jax import LLM, SamplingParams, EngineConfig
print(before == state(), before, state())
"""


def test_importing_nori_jax_changes_no_jax_state():
    out = subprocess.run([sys.executable, "-c", SNAPSHOT], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("True"), out.stdout


@pytest.fixture(scope="module")
def llm():
    return LLM(
        "tiny-llama",
        load_format="dummy",
        dtype="float32",
        page_size=16,
        num_pages=32,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        max_model_len=64,
    )


def test_user_compiles_are_not_the_engines(llm):
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm.generate([[5, 6, 7]], params)
    # The user's own program, compiled on this thread between and during engine use.
    f = jax.jit(lambda x: jnp.sin(x) * 3 + 1)
    f(jnp.ones(7))
    llm.generate([[8, 9]], params)
    assert llm.engine.num_recompiles == 0
    assert llm.get_metrics()["nori:recompiles_total"] == 0


def test_a_compile_inside_the_engines_step_is_counted(llm):
    runner = llm.engine.runner
    real = runner.launch

    def launch_that_compiles(plan):
        jax.jit(lambda x: x * 2 - 1)(jnp.zeros(3 + plan.bucket % 5))  # a fresh program
        return real(plan)

    runner.launch = launch_that_compiles
    try:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    finally:
        del runner.launch
    assert llm.engine.num_recompiles >= 1


def test_a_configured_compilation_cache_is_left_alone(tmp_path):
    from nori_jax.executor import compilation_cache

    old = jax.config.jax_compilation_cache_dir
    try:
        jax.config.update("jax_compilation_cache_dir", str(tmp_path / "theirs"))
        assert compilation_cache.enable(None) == tmp_path / "theirs"
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "theirs")
        assert compilation_cache.enable(tmp_path / "asked") == tmp_path / "asked"  # explicit wins
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "asked")
    finally:
        jax.config.update("jax_compilation_cache_dir", old)
