"""Shared fixtures: tiny random Hugging Face checkpoints made by transformers itself."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import interpret_callbacks
import pytest

# GPU interpret mode (the Pallas kernel tests) runs each simulated warpgroup as an XLA CPU program
# whose host callbacks block on the kernel's barriers. Those callbacks run on XLA's CPU thread
# pool, one thread per core by default: on a 2-core machine two warpgroups waiting on a barrier
# held both threads, the warpgroups they waited for never ran, and the kernel tests hung for good
# (no CPU used; pytest-timeout's signal method cannot interrupt the wait). XLA sizes the pool from
# NPROC when it is set; it must be set before JAX starts its CPU client.
os.environ.setdefault("NPROC", "16")

# PyTorch (the transformers references) runs its CPU ops on OpenMP threads that spin while they
# wait. With pytest's two workers on CI's two cores, the other worker's process takes the core a
# spinning thread waits for: the HF parity test took 165 s in a full run against 17 s alone (53 s
# beside one busy core, 20 s with one thread). One thread per process; set before torch loads.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Most of an engine test's time on CI is XLA compiling its programs for the CPU, and LLVM's
# optimization passes are much of that. Level 1 drops the costlier passes and still gives the
# real 135M model's tests code fast enough to run (level 0 does not). From an empty compilation
# cache on the 2-core machine: tests/test_engine.py with tests/quantization/test_quantized_engine.py
# take 122 s at levels 0 and 1 against 149 s at XLA's default (2); the README's Python example on
# the embedded model takes 29 s at level 1, 37 s at 2 and 54 s at 0. XLA's switch for LLVM's
# expensive passes takes more off: the same two files 201 against 246 s of CPU time (114 against
# 137 s on two workers), the first-contact and GGUF parity tests on the embedded model 158
# against 183 s. Neither changes the floating-point semantics (XLA's CPU fast-math options, off
# by default, are flags of their own), and the exact-token tests pass under both.
# Set before JAX starts its CPU client; a value given in XLA_FLAGS wins (tests/cpu_devices.py
# passes them to the mesh tests' subprocesses, and servers the tests start inherit them).
_TEST_XLA_FLAGS = {
    "xla_backend_optimization_level": "1",
    "xla_llvm_disable_expensive_passes": "true",
}
for _name, _value in _TEST_XLA_FLAGS.items():
    if _name not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --{_name}={_value}").strip()

# Tests build many small programs; keep them across runs (CI reuses ~/.cache when it can).
os.environ.setdefault("NORI_JAX_CACHE_DIR", str(Path("~/.cache/nori_jax/xla-tests").expanduser()))

# Interpret-mode kernels hand their host callbacks numpy arguments instead of placing each on the
# CPU device first: the kernel test file alone took 240 against 411 s from an empty cache on the
# 2-core machine (interpret_callbacks.py).
interpret_callbacks.install()


@pytest.fixture(autouse=True)
def _cli_logging_undone():
    """Tests that call the CLI in-process (nori_jax.cli.main) run cli_logging.configure, whose
    logging.basicConfig(force=True) gives the root logger a StreamHandler on the stream of that
    moment: a test's capsys buffer, closed when the test ends. Every later record of the worker
    then went there (lost, or a "Logging error" in the output when the buffer was closed).
    Remove what a test added, and restore the root level."""
    root = logging.getLogger()
    before, level = set(root.handlers), root.level
    yield
    for handler in [h for h in root.handlers if type(h) is logging.StreamHandler]:
        if handler not in before:
            root.removeHandler(handler)
    root.setLevel(level)


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


def _save_random(config, path: Path) -> Path:
    """A random model of `config` saved with save_pretrained (safetensors) in `path`."""
    import torch
    from transformers import AutoModelForCausalLM

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
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """name -> directory of a tiny random model saved with save_pretrained (safetensors)."""
    return {
        name: _save_random(config, tmp_path_factory.mktemp(f"hf-{name}"))
        for name, config in _hf_configs().items()
    }


@pytest.fixture(scope="session")
def tp_checkpoint(tmp_path_factory) -> Path:
    """A tiny llama whose heads split 2, 4 and 8 ways: 8 q heads, 4 kv heads of 16 (at tp 8
    each kv head is stored twice), MLP 256, vocab 320."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        **dict(TINY_COMMON, hidden_size=128, intermediate_size=256, num_attention_heads=8),
        num_key_value_heads=4,
        head_dim=16,
        tie_word_embeddings=False,
    )
    return _save_random(config, tmp_path_factory.mktemp("hf-tp"))


@pytest.fixture(scope="session")
def kernel_tp_checkpoint(tmp_path_factory) -> Path:
    """One layer of 4 q / 2 kv heads: the model of the Pallas engine under tensor parallelism
    (interpret mode costs seconds per kernel call and device, so it has one layer)."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        **dict(TINY_COMMON, num_hidden_layers=1), num_key_value_heads=2, tie_word_embeddings=False
    )
    return _save_random(config, tmp_path_factory.mktemp("hf-kernel-tp"))
