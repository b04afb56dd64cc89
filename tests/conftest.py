"""Shared fixtures: tiny random Hugging Face checkpoints made by transformers itself."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# GPU interpret mode (the Pallas kernel tests) runs each simulated warpgroup as an XLA CPU program
# whose host callbacks block on the kernel's barriers. Those callbacks run on XLA's CPU thread
# pool, one thread per core by default: on a 2-core machine two warpgroups waiting on a barrier
# held both threads, the warpgroups they waited for never ran, and the kernel tests hung for good
# (no CPU used; pytest-timeout's signal method cannot interrupt the wait). XLA sizes the pool from
# NPROC when it is set; it must be set before JAX starts its CPU client.
os.environ.setdefault("NPROC", "16")

# Tests build many small programs; keep them across runs (CI reuses ~/.cache when it can).
os.environ.setdefault("NORI_JAX_CACHE_DIR", str(Path("~/.cache/nori_jax/xla-tests").expanduser()))

TINY_COMMON = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
)


def _hf_configs():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    return {
        # GQA, llama3 rope scaling, untied embeddings.
        "llama": LlamaConfig(
            **TINY_COMMON,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
        # qkv bias, tied embeddings, MQA.
        "qwen2": Qwen2Config(
            **TINY_COMMON, num_key_value_heads=1, tie_word_embeddings=True, use_sliding_window=False
        ),
        "mistral": MistralConfig(
            **TINY_COMMON, num_key_value_heads=2, sliding_window=None, tie_word_embeddings=False
        ),
    }


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """name -> directory of a tiny random model saved with save_pretrained (safetensors)."""
    import torch
    from transformers import AutoModelForCausalLM

    out = {}
    for name, config in _hf_configs().items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
        # HF's default init (std 0.02) leaves logits nearly flat; scale weights up so greedy
        # decoding has clear winners and the comparison tests the model, not rounding noise.
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if pname.endswith("bias"):
                    p.normal_(0.0, 0.5)  # HF initialises biases to 0, which would test nothing
                elif p.ndim > 1:
                    p.mul_(4.0)
        path = tmp_path_factory.mktemp(f"hf-{name}")
        model.save_pretrained(path, safe_serialization=True)
        out[name] = path
    return out
