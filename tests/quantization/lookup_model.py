"""A tiny Llama checkpoint whose greedy tokens have clear margins and depend on the quantized
layers (for the quantized engine's token tests).

Layer 0's MLP is a lookup table: gate row k (and up row k) is token k's embedding direction, so
for a residual near E[t] only unit t fires, and down column t adds E[perm[t]] - E[t]. The LM head
is the embedding, so the model's next token is perm[t]: without that MLP it would repeat t, so a
wrong quantized matmul changes the tokens. Every other weight is random (std 0.04), large
enough to move the logits, too small to flip a token: the top logit leads the runner-up by
several units while fp8 / int8 / int4 move logits by tenths at most (the tests measure both).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

VOCAB, HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS = 256, 128, 256, 2, 4, 2
HEAD_DIM = HIDDEN // HEADS


def write_lookup_model(path: Path, seed: int = 0) -> np.ndarray:
    """Write config.json + model.safetensors to `path`; return the permutation perm."""
    rng = np.random.default_rng(seed)
    path.mkdir(parents=True, exist_ok=True)
    e = rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32)
    e *= np.sqrt(HIDDEN) / np.linalg.norm(e, axis=1, keepdims=True)  # rows of RMS 1
    perm = rng.permutation(VOCAB)

    def normal(*shape: int, std: float = 0.04) -> np.ndarray:
        return (std * rng.standard_normal(shape)).astype(np.float32)

    unit = e / np.sqrt(HIDDEN)  # unit-norm rows
    fired = np.sqrt(HIDDEN)  # a unit's pre-activation when the residual is its own token
    silu = fired / (1 + np.exp(-fired))
    t: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": e,
        "model.norm.weight": np.ones(HIDDEN, np.float32),
        "lm_head.weight": unit.copy(),
    }
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        t |= {
            p + "input_layernorm.weight": np.ones(HIDDEN, np.float32),
            p + "post_attention_layernorm.weight": np.ones(HIDDEN, np.float32),
            p + "self_attn.q_proj.weight": normal(HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": normal(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": normal(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": normal(HIDDEN, HEADS * HEAD_DIM),
        }
        if i == 0:
            down = (e[perm] - e).T / (silu * fired)  # [HIDDEN, INTERMEDIATE]: column k
            t |= {
                p + "mlp.gate_proj.weight": unit.copy(),
                p + "mlp.up_proj.weight": unit.copy(),
                p + "mlp.down_proj.weight": np.ascontiguousarray(down, np.float32),
            }
        else:
            t |= {
                p + "mlp.gate_proj.weight": normal(INTERMEDIATE, HIDDEN),
                p + "mlp.up_proj.weight": normal(INTERMEDIATE, HIDDEN),
                p + "mlp.down_proj.weight": normal(HIDDEN, INTERMEDIATE),
            }
    save_file(t, str(path / "model.safetensors"))
    config = {
        "model_type": "llama",
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    (path / "config.json").write_text(json.dumps(config))
    return perm
