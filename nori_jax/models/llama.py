"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2) over the paged KV cache.

Every parameter carries its tensor-parallel sharding as metadata (`out_sharding`, Megatron style
over the mesh axis `model`: q/k/v/gate/up split by output columns, o/down by input rows,
embeddings by vocab), so tensor parallelism is a mesh configuration, not a rewrite. Float kernels
are stored [in, out]; quantized linear layers (`quantization=`) as models/linear.py describes.

Shapes: T = tokens of the step, H = hidden, Hq/Hkv = heads, D = head_dim, V = vocab, F = MLP width.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from nori_jax.model_config import ModelConfig
from nori_jax.models.linear import COLUMN, MODEL, ROW, linear, linear_weight, param
from nori_jax.models.rope import apply_rope, inverse_frequencies, rope_cos_sin
from nori_jax.quantization.scheme import WeightQuantization
from pallas_kernels import attention_step

ATTENTION_SCOPE = "paged_attention"


@dataclasses.dataclass(frozen=True)
class AttentionInputs:
    """The StepPlan's attention metadata as device arrays (see ragged_paged_attention)."""

    slot_mapping: jax.Array  # int32[T]
    kv_lens: jax.Array  # int32[S]
    page_table: jax.Array  # int32[S, MP]
    cu_q_lens: jax.Array  # int32[S + 1]
    distribution: jax.Array  # int32[2]


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype, rngs: nnx.Rngs):
        self.weight = param(rngs, (dim,), dtype, (None,), init="ones")
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:  # [T, H] -> [T, H]
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * y.astype(x.dtype)


class Attention(nnx.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        dtype,
        backend: str,
        rngs: nnx.Rngs,
        quant: WeightQuantization | None,
    ):
        h, d = cfg.hidden_size, cfg.head_dim
        q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.q_proj = linear_weight(rngs, h, q, dtype, COLUMN, quant, "self_attn.q_proj")
        self.k_proj = linear_weight(rngs, h, kv, dtype, COLUMN, quant, "self_attn.k_proj")
        self.v_proj = linear_weight(rngs, h, kv, dtype, COLUMN, quant, "self_attn.v_proj")
        self.o_proj = linear_weight(rngs, q, h, dtype, ROW, quant, "self_attn.o_proj")
        if cfg.attention_bias:
            self.q_bias = param(rngs, (cfg.num_heads * d,), dtype, (MODEL,), init="zeros")
            self.k_bias = param(rngs, (cfg.num_kv_heads * d,), dtype, (MODEL,), init="zeros")
            self.v_bias = param(rngs, (cfg.num_kv_heads * d,), dtype, (MODEL,), init="zeros")
        self.has_bias = cfg.attention_bias
        self.sm_scale = d**-0.5
        self.backend = backend

    def __call__(self, x, cos, sin, kv_pages, meta: AttentionInputs, kv_scales=None):
        """`kv_scales`: f32[2] (k_scale, v_scale) of fp8 pages; None: the default scales."""
        t = x.shape[0]
        q, k, v = linear(x, self.q_proj), linear(x, self.k_proj), linear(x, self.v_proj)
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
                kv_scales=kv_scales,
            )
        return linear(out.reshape(t, self.num_heads * self.head_dim), self.o_proj), kv_pages


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, quant: WeightQuantization | None):
        h, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = linear_weight(rngs, h, f, dtype, COLUMN, quant, "mlp.gate_proj")
        self.up_proj = linear_weight(rngs, h, f, dtype, COLUMN, quant, "mlp.up_proj")
        self.down_proj = linear_weight(rngs, f, h, dtype, ROW, quant, "mlp.down_proj")

    def __call__(self, x: jax.Array) -> jax.Array:
        gated = jax.nn.silu(linear(x, self.gate_proj)) * linear(x, self.up_proj)
        return linear(gated, self.down_proj)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, backend: str, rngs: nnx.Rngs, quant=None):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, rngs)
        self.self_attn = Attention(cfg, dtype, backend, rngs, quant)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, rngs)
        self.mlp = MLP(cfg, dtype, rngs, quant)

    def __call__(self, x, cos, sin, kv_pages, meta, kv_scales=None):
        attn, kv_pages = self.self_attn(
            self.input_layernorm(x), cos, sin, kv_pages, meta, kv_scales
        )
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), kv_pages


class LlamaForCausalLM(nnx.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        dtype,
        rngs: nnx.Rngs,
        attention_backend: str = "reference",
        quantization: WeightQuantization | None = None,
    ):
        """`quantization`: how the decoder's linear layers store their weights (None: float
        kernels in `dtype`); embeddings, LM head and norms stay in `dtype`."""
        self.config = cfg
        self.embed_tokens = param(rngs, (cfg.vocab_size, cfg.hidden_size), dtype, (MODEL, None))
        self.layers = nnx.List(
            [
                DecoderLayer(cfg, dtype, attention_backend, rngs, quantization)
                for _ in range(cfg.num_layers)
            ]
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, rngs)
        if not cfg.tie_word_embeddings:
            self.lm_head = param(rngs, (cfg.hidden_size, cfg.vocab_size), dtype, (None, MODEL))

    def __call__(
        self,
        input_ids: jax.Array,  # int32[T]
        positions: jax.Array,  # int32[T]
        kv_pages: list[jax.Array],  # num_layers x [P, Hkv, 2, PS, D]
        meta: AttentionInputs,
        kv_scales: jax.Array | None = None,  # f32[num_layers, 2] of fp8 pages; None: default
    ) -> tuple[jax.Array, list[jax.Array]]:
        """Run the decoder over the step's tokens: final hidden states [T, H] and new pages."""
        x = self.embed_tokens[...][input_ids]
        cos, sin = rope_cos_sin(positions, inverse_frequencies(self.config))
        new_pages = []
        for i, (layer, pages) in enumerate(zip(self.layers, kv_pages, strict=True)):
            scales = None if kv_scales is None else kv_scales[i]
            x, pages = layer(x, cos, sin, pages, meta, scales)
            new_pages.append(pages)
        return self.norm(x), new_pages

    def compute_logits(self, hidden: jax.Array) -> jax.Array:  # [S, H] -> float32[S, V]
        if self.config.tie_word_embeddings:
            logits = hidden @ self.embed_tokens[...].T
        else:
            logits = hidden @ self.lm_head[...]
        return logits.astype(jnp.float32)
