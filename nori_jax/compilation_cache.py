"""JAX's persistent compilation cache, on for every engine, including small programs."""

from __future__ import annotations

from pathlib import Path

import jax

from nori_jax.cache_paths import compilation_cache_dir


def enable(cache_dir: str | None = None) -> Path:
    path = compilation_cache_dir(cache_dir)
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    # The defaults skip programs that compile in under a second: on CPU that is nearly all of ours.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path
