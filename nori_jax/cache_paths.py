"""Where the engine's on-disk caches live (JAX-free, for the CLI's `cache` command)."""

from __future__ import annotations

import os
from pathlib import Path


def compilation_cache_dir(cache_dir: str | None = None) -> Path:
    """XLA's persistent compilation cache: `cache_dir`, else $NORI_JAX_CACHE_DIR, else
    ~/.cache/nori_jax/xla."""
    return Path(
        cache_dir or os.environ.get("NORI_JAX_CACHE_DIR") or "~/.cache/nori_jax/xla"
    ).expanduser()


def param_cache_dir() -> Path:
    """Converted parameters (orbax): $NORI_JAX_PARAM_CACHE, else ~/.cache/nori_jax/params."""
    return Path(os.environ.get("NORI_JAX_PARAM_CACHE", "~/.cache/nori_jax/params")).expanduser()
