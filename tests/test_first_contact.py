"""A new user's first commands, as the README gives them: each in a fresh process with an empty
compilation cache. They must pick the small CPU preset (the GPU-sized defaults took over half an
hour to compile here) and answer. How long they take is measured by
benchmarks/engine/first_contact.py and written in the README, not asserted."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from readme_snippets import readme_command, readme_python_example

CHECK_CONFIG = """
from nori_jax.engine_config import EngineConfig
from nori_jax.engine_defaults import CPU_PRESET
assert llm.engine.config == EngineConfig.from_preset(CPU_PRESET, {}), llm.engine.config
print("CONFIG-OK", llm.engine.scheduler.buckets)
"""


def _fresh_env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["NORI_JAX_CACHE_DIR"] = str(tmp_path / "xla")  # empty: every bucket compiles
    return env


def test_readme_python_example_picks_the_cpu_preset(tmp_path):
    code = readme_python_example() + CHECK_CONFIG
    r = subprocess.run(
        [sys.executable, "-c", code],
        env=_fresh_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Paris" in r.stdout and "CONFIG-OK [16, 32, 64, 128]" in r.stdout, r.stdout
    assert "\n8 1\n" in r.stdout, r.stdout  # n=4 samples of each of two prompts
    assert any((tmp_path / "xla").iterdir())  # it did compile into the empty cache


def test_readme_generate_command_picks_the_cpu_preset_and_shows_progress(tmp_path):
    r = subprocess.run(
        readme_command("generate"),
        env=_fresh_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip()
    log = r.stderr
    assert "engine config: preset 'cpu', the default on a cpu backend" in log
    for progress in ("loading model", "model loaded in", "bucket 128 compiled in",
                     "bucket 128 warmed up in", "XLA compilation cache: " + str(tmp_path / "xla"),
                     "engine ready in"):  # fmt: skip
        assert progress in log, progress
    # Messages a user cannot act on stay out of the default log level.
    assert "Unable to initialize backend" not in log and "absl" not in log
