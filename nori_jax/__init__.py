"""Nori-JAX: an LLM inference engine in JAX/XLA for GPUs.

The public names load lazily, so light submodules (the load generator, the tokenizer) import
without pulling in JAX and the model.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "LLM": "nori_jax.llm",
    "EngineConfig": "nori_jax.engine_config",
    "LLMEngine": "nori_jax.engine",
    "MeshConfig": "nori_jax.mesh_config",
    "QueueFullError": "nori_jax.scheduler",
    "RequestMetrics": "nori_jax.outputs",
    "RequestOutput": "nori_jax.outputs",
    "SamplingParams": "nori_jax.sampling_params",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from nori_jax.engine import LLMEngine  # noqa: F401
    from nori_jax.engine_config import EngineConfig  # noqa: F401
    from nori_jax.llm import LLM  # noqa: F401
    from nori_jax.mesh_config import MeshConfig  # noqa: F401
    from nori_jax.outputs import RequestMetrics, RequestOutput  # noqa: F401
    from nori_jax.sampling_params import SamplingParams  # noqa: F401
    from nori_jax.scheduler import QueueFullError  # noqa: F401


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'nori_jax' has no attribute {name!r}")
