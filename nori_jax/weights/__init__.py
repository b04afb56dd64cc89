"""Checkpoint loaders: every format yields Hugging Face tensor names and config keys."""

from nori_jax.weights.default_model import default_model_path
from nori_jax.weights.gguf import GGUFCheckpoint, load_gguf

__all__ = ["GGUFCheckpoint", "default_model_path", "load_gguf"]
