"""JAX's persistent compilation cache for the engine's programs.

The cache is a process-wide JAX setting, so the engine touches it only when asked or when the
process has none: an explicit directory turns it on there (caching every program, including the
small ones JAX skips by default, which on CPU is nearly all of ours); with none given, the
project's directory is used only if the process has no cache configured, and a cache the user set
up stays exactly as it is. Importing nori_jax changes nothing.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import jax

from nori_jax.cache_paths import compilation_cache_dir

logger = logging.getLogger(__name__)
DEFAULT_DIR = "~/.cache/nori_jax/xla"


def default_dir() -> Path:
    return compilation_cache_dir(None)


def enable(cache_dir: str | os.PathLike | None = None) -> Path | None:
    """Point JAX's persistent cache at `cache_dir`, or (None) at the default directory unless
    the process already has a cache. Returns the directory in use (None if none)."""
    current = jax.config.jax_compilation_cache_dir
    if cache_dir is None and current:
        logger.info("compilation cache: the process's own, %s", current)
        return Path(current)
    path = Path(cache_dir).expanduser() if cache_dir is not None else default_dir()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    logger.info("compilation cache: %s", path)
    return path
