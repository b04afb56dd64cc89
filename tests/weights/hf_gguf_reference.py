"""Hugging Face transformers loading a GGUF file: the reference our GGUF loader is checked against.

Loaded once per process (functools.cache), since transformers takes ~40 s to dequantize SmolLM2
and ~15 s to build its tokenizer. For the model-parity tests to come:

    hf_model, ours = load_reference(default_model_path())
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from nori_jax.weights.gguf import GGUFCheckpoint, load_gguf


@functools.cache
def hf_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@functools.cache
def hf_model(path: Path) -> Any:
    """transformers' float32 model of the GGUF file, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


@functools.cache
def checkpoint(path: Path) -> GGUFCheckpoint:
    return load_gguf(path)


def load_reference(path: str | Path) -> tuple[Any, GGUFCheckpoint]:
    """(transformers model, our checkpoint) for the same GGUF file, both cached per process."""
    path = Path(path).resolve()
    return hf_model(path), checkpoint(path)
