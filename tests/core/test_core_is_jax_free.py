"""The engine core (scheduler, allocator, plan builder, outputs, engine loop) imports no JAX."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import nori_jax.core


def test_importing_every_core_module_loads_no_jax():
    modules = [f"nori_jax.core.{m.name}" for m in pkgutil.iter_modules(nori_jax.core.__path__)]
    assert "nori_jax.core.scheduler" in modules and "nori_jax.core.engine_core" in modules
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax'))\n"
        "print(len(bad), bad[:5])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("0 "), out.stdout + out.stderr
