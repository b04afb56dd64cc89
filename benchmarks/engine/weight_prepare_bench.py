"""How fast the loader prepares a checkpoint's tensors on the host (`prepare_tensors`: names
mapped, q/k/v and gate/up fused, kernels laid out as the model holds them, dtypes cast), before
anything is placed: two layers of the Llama-3.1-8B shape plus its embedding, LM head and norm
(bf16, 2.97 GB of random values), three times. The host half of loading and of
`update_weights`; `weight_place_bench.py` times the other.

    python benchmarks/engine/weight_prepare_bench.py

Each repeat allocates its results afresh, as an update does; the first touch of new memory is
part of what it times.
"""

from __future__ import annotations

import dataclasses
import time

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from nori_jax.model_config import ModelConfig, load_preset
from nori_jax.weights.loader import abstract_model, prepare_tensors

LAYERS = 2


def checkpoint(cfg: ModelConfig) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    h, f, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    shapes = {
        "self_attn.q_proj.weight": (cfg.num_heads * d, h),
        "self_attn.k_proj.weight": (cfg.num_kv_heads * d, h),
        "self_attn.v_proj.weight": (cfg.num_kv_heads * d, h),
        "self_attn.o_proj.weight": (h, cfg.num_heads * d),
        "mlp.gate_proj.weight": (f, h),
        "mlp.up_proj.weight": (f, h),
        "mlp.down_proj.weight": (h, f),
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
    }
    tensors = {
        f"model.layers.{layer}.{name}": rng.standard_normal(shape, np.float32)
        for layer in range(LAYERS)
        for name, shape in shapes.items()
    }
    tensors["model.embed_tokens.weight"] = rng.standard_normal((cfg.vocab_size, h), np.float32)
    tensors["lm_head.weight"] = rng.standard_normal((cfg.vocab_size, h), np.float32)
    tensors["model.norm.weight"] = np.ones(h, np.float32)
    return {name: a.astype(ml_dtypes.bfloat16) for name, a in tensors.items()}


def main() -> None:
    cfg = dataclasses.replace(
        ModelConfig.from_hf_dict(load_preset("llama3.1-8b")), num_layers=LAYERS
    )
    _, state = abstract_model(cfg, jnp.bfloat16, "reference")
    tensors = checkpoint(cfg)
    nbytes = sum(a.nbytes for a in tensors.values())
    for rep in range(3):
        start = time.perf_counter()
        prepared = list(
            prepare_tensors(tensors.items(), state, "bench", num_kv_heads=cfg.num_kv_heads)
        )
        seconds = time.perf_counter() - start
        rate = nbytes / seconds / 1e9
        print(f"repeat {rep}: {seconds:.3f} s, {rate:.2f} GB/s of {nbytes / 1e9:.2f} GB")
        del prepared


if __name__ == "__main__":
    main()
