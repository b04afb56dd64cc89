"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2) over the paged KV cache.

Every parameter carries its tensor-parallel sharding as metadata (`out_sharding`, Megatron style
over the mesh axis `model`: q/k/v/gate/up split by output columns, o/down by input rows,
embeddings by vocab), so tensor parallelism is a mesh configuration, not a rewrite. Kernels are
stored [in, out].

Shapes: T = tokens of the step, H = hidden, Hq/Hkv = heads, D = head_dim, V = vocab, F = MLP width.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from nori_jax.model_config import ModelConfig
from nori_jax.models.rope import apply_rope, inverse_frequencies, rope_cos_sin
from pallas_kernels import attention_step

MODEL = "model"  # mesh axis for tensor parallelism
ATTENTION_SCOPE = "paged_attention"


@dataclasses.dataclass(frozen=True)
class AttentionInputs:
    """The StepPlan's attention metadata as device arrays (see ragged_paged_attention)."""

    slot_mapping: jax.Array  # int32[T]
    kv_lens: jax.Array  # int32[S]
    page_table: jax.Array  # int32[S, MP]
    cu_q_lens: jax.Array  # int32[S + 1]
    distribution: jax.Array  # int32[2]


def _param(
    rngs: nnx.Rngs, shape: tuple[int, ...], dtype, sharding: tuple[str | None, ...], init="normal"
):
    if init == "ones":
        value = jnp.ones(shape, dtype)
    elif init == "zeros":
        value = jnp.zeros(shape, dtype)
    else:
        value = (0.02 * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    # Sharding is metadata here; the loader places each array on the mesh (weights/placement.py).
    return nnx.Param(value, eager_sharding=False, out_sharding=sharding)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype, rngs: nnx.Rngs):
        self.weight = _param(rngs, (dim,), dtype, (None,), init="ones")
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:  # [T, H] -> [T, H]
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * y.astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, backend: str, rngs: nnx.Rngs):
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.q_proj = _param(rngs, (h, cfg.num_heads * d), dtype, (None, MODEL))
        self.k_proj = _param(rngs, (h, cfg.num_kv_heads * d), dtype, (None, MODEL))
        self.v_proj = _param(rngs, (h, cfg.num_kv_heads * d), dtype, (None, MODEL))
        self.o_proj = _param(rngs, (cfg.num_heads * d, h), dtype, (MODEL, None))
        if cfg.attention_bias:
            self.q_bias = _param(rngs, (cfg.num_heads * d,), dtype, (MODEL,), init="zeros")
            self.k_bias = _param(rngs, (cfg.num_kv_heads * d,), dtype, (MODEL,), init="zeros")
            self.v_bias = _param(rngs, (cfg.num_kv_heads * d,), dtype, (MODEL,), init="zeros")
        self.has_bias = cfg.attention_bias
        self.sm_scale = d**-0.5
        self.backend = backend

    def __call__(self, x, cos, sin, kv_pages, meta: AttentionInputs):
        t = x.shape[0]
        q, k, v = x @ self.q_proj[...], x @ self.k_proj[...], x @ self.v_proj[...]
        if self.has_bias:
            q, k, v = q + self.q_bias[...], k + self.k_bias[...], v + self.v_bias[...]
        q = apply_rope(q.reshape(t, self.num_heads, self.head_dim), cos, sin)  # [T, Hq, D]
        k = apply_rope(k.reshape(t, self.num_kv_heads, self.head_dim), cos, sin)  # [T, Hkv, D]
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        # The scope names the attention's ops in the compiled HLO: its loops (the reference's
        # page loop, a kernel's) are the only control flow the step may hold (test_step_hlo.py).
        with jax.named_scope(ATTENTION_SCOPE):
            out, kv_pages = attention_step(
                q,
                k,
                v,
                kv_pages,
                meta.slot_mapping,
                meta.kv_lens,
                meta.page_table,
                meta.cu_q_lens,
                meta.distribution,
                sm_scale=self.sm_scale,
                backend=self.backend,
            )
        return out.reshape(t, self.num_heads * self.head_dim) @ self.o_proj[...], kv_pages


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        h, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = _param(rngs, (h, f), dtype, (None, MODEL))
        self.up_proj = _param(rngs, (h, f), dtype, (None, MODEL))
        self.down_proj = _param(rngs, (f, h), dtype, (MODEL, None))

    def __call__(self, x: jax.Array) -> jax.Array:
        return (jax.nn.silu(x @ self.gate_proj[...]) * (x @ self.up_proj[...])) @ self.down_proj[
            ...
        ]


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, backend: str, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, rngs)
        self.self_attn = Attention(cfg, dtype, backend, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, rngs)
        self.mlp = MLP(cfg, dtype, rngs)

    def __call__(self, x, cos, sin, kv_pages, meta):
        attn, kv_pages = self.self_attn(self.input_layernorm(x), cos, sin, kv_pages, meta)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), kv_pages


class LlamaForCausalLM(nnx.Module):
    def __init__(
        self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, attention_backend: str = "reference"
    ):
        self.config = cfg
        self.embed_tokens = _param(rngs, (cfg.vocab_size, cfg.hidden_size), dtype, (MODEL, None))
        self.layers = nnx.List(
            [DecoderLayer(cfg, dtype, attention_backend, rngs) for _ in range(cfg.num_layers)]
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, rngs)
        if not cfg.tie_word_embeddings:
            self.lm_head = _param(rngs, (cfg.hidden_size, cfg.vocab_size), dtype, (None, MODEL))

    def __call__(
        self,
        input_ids: jax.Array,  # int32[T]
        positions: jax.Array,  # int32[T]
        kv_pages: list[jax.Array],  # num_layers x [P, Hkv, 2, PS, D]
        meta: AttentionInputs,
    ) -> tuple[jax.Array, list[jax.Array]]:
        """Run the decoder over the step's tokens: final hidden states [T, H] and new pages."""
        x = self.embed_tokens[...][input_ids]
        cos, sin = rope_cos_sin(positions, inverse_frequencies(self.config))
        new_pages = []
        for layer, pages in zip(self.layers, kv_pages, strict=True):
            x, pages = layer(x, cos, sin, pages, meta)
            new_pages.append(pages)
        return self.norm(x), new_pages

    def compute_logits(self, hidden: jax.Array) -> jax.Array:  # [S, H] -> float32[S, V]
        if self.config.tie_word_embeddings:
            logits = hidden @ self.embed_tokens[...].T
        else:
            logits = hidden @ self.lm_head[...]
        return logits.astype(jnp.float32)
