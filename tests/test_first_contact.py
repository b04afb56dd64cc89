"""A new user's first commands, as the README gives them: each in a fresh process, the first
one with an empty compilation cache. They must pick the small CPU preset (the GPU-sized defaults
took over half an hour to compile here) and answer. The second command finds the first one's
programs in the cache (the same preset: a wrong one would compile its own, slowly, and name
itself in the log). How long they take is measured by benchmarks/engine/first_contact.py and
written in the README, not asserted."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from readme_snippets import readme_command, readme_python_example

CHECK_CONFIG = """
from nori_jax.engine_config import EngineConfig
from nori_jax.engine_defaults import CPU_PRESET
assert llm.engine.config == EngineConfig.from_preset(CPU_PRESET, {}), llm.engine.config
print("CONFIG-OK", llm.engine.scheduler.buckets)
"""


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    """This module's compilation cache, empty when its first test starts."""
    return tmp_path_factory.mktemp("first_contact") / "xla"


def _fresh_env(cache_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["NORI_JAX_CACHE_DIR"] = str(cache_dir)
    return env


def test_readme_python_example_picks_the_cpu_preset(cache_dir):
    code = readme_python_example() + CHECK_CONFIG
    fresh = not cache_dir.exists()  # this test ran first: every bucket compiles
    r = subprocess.run(
        [sys.executable, "-c", code],
        env=_fresh_env(cache_dir),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Paris" in r.stdout and "CONFIG-OK [16, 32, 64, 128]" in r.stdout, r.stdout
    assert "\n8 1\n" in r.stdout, r.stdout  # n=4 samples of each of two prompts
    if fresh:
        assert any(cache_dir.iterdir())  # it did compile into the empty cache


def test_readme_generate_command_picks_the_cpu_preset_and_shows_progress(cache_dir):
    r = subprocess.run(
        readme_command("generate"),
        env=_fresh_env(cache_dir),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip()
    log = r.stderr
    assert "engine config: preset 'cpu', the default on a cpu backend" in log
    for progress in ("loading model", "model loaded in", "bucket 128 compiled in",
                     "bucket 128 warmed up in", "XLA compilation cache: " + str(cache_dir),
                     "engine ready in"):  # fmt: skip
        assert progress in log, progress
    # Messages a user cannot act on stay out of the default log level.
    assert "Unable to initialize backend" not in log and "absl" not in log
