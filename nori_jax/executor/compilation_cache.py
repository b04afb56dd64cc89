"""JAX's persistent compilation cache, on for every engine, including small programs."""

from __future__ import annotations

import os
from pathlib import Path

import jax


def enable(cache_dir: str | None = None) -> Path:
    path = Path(
        cache_dir or os.environ.get("NORI_JAX_CACHE_DIR") or "~/.cache/nori_jax/xla"
    ).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    # The defaults skip programs that compile in under a second: on CPU that is nearly all of ours.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path
