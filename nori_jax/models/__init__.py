"""Model definitions (Flax NNX)."""

from nori_jax.models.llama import LlamaForCausalLM

__all__ = ["LlamaForCausalLM"]
