"""Nori-JAX: an LLM inference engine in JAX/XLA for GPUs."""

from nori_jax.engine import LLMEngine
from nori_jax.engine_config import EngineConfig
from nori_jax.llm import LLM
from nori_jax.mesh import MeshConfig
from nori_jax.outputs import RequestMetrics, RequestOutput
from nori_jax.sampling_params import SamplingParams
from nori_jax.scheduler import QueueFullError

__all__ = [
    "LLM",
    "EngineConfig",
    "LLMEngine",
    "MeshConfig",
    "QueueFullError",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
]
