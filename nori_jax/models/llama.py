"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2) over the paged KV cache.

Every parameter carries its tensor-parallel sharding as metadata (`out_sharding`, Megatron style
over the mesh axis `model`: q/k/v/gate/up split by output columns, o/down by input rows,
embeddings by vocab), so tensor parallelism is a mesh configuration, not a rewrite. q/k/v are one
matmul (`qkv_proj`) and gate/up another (`gate_up_proj`), in a layout whose column split gives
each device its own heads and columns (models/fused_layout.py). Float kernels
are stored [in, out]; quantized linear layers (`quantization=`) as models/linear.py describes.

On a mesh whose `model` axis has tp > 1 devices, the attention step runs under `shard_map` over
kv heads (pallas_kernels/ragged_paged_attention/sharded.py): each device writes and attends over
its own heads and page slices. With fewer kv heads than devices, k_proj and v_proj are replicated
(and q_proj, split, a matmul of its own) and the pages store each kv head tp / Hkv times. The
collectives of a layer are the two all-reduces XLA inserts after the row-parallel o_proj and
down_proj (tests/test_tensor_parallel.py counts them in the compiled step).

Shapes: T = tokens of the step, H = hidden, Hq/Hkv = heads, D = head_dim, V = vocab, F = MLP width.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from nori_jax.model_config import ModelConfig
from nori_jax.models.fused_layout import split_gate_up, split_qkv
from nori_jax.models.linear import (
    COLUMN,
    MODEL,
    REPLICATED,
    ROW,
    linear,
    linear_weight,
    param,
    use_small_matmul,
)
from nori_jax.models.rope import apply_rope, inverse_frequencies, rope_cos_sin
from nori_jax.quantization.scheme import WeightQuantization
from pallas_kernels import attention_step, attention_step_sharded
from pallas_kernels.page_constants import stored_kv_heads
from pallas_kernels.ragged_paged_attention.tuning_overrides import TuningOverrides

ATTENTION_SCOPE = "paged_attention"
# The row-parallel layers, whose partial sums are all-reduced under tensor parallelism: named in
# the compiled HLO so a test can count the collectives per layer.
O_PROJ_SCOPE, DOWN_PROJ_SCOPE = "o_proj", "down_proj"


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
        mesh: Mesh | None,
    ):
        h, d = cfg.hidden_size, cfg.head_dim
        q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        # The mesh to split the attention step over; None on one device (no shard_map).
        tp = 1 if mesh is None else mesh.shape[MODEL]
        self.mesh = mesh if tp > 1 else None
        # Fewer kv heads than devices: every device computes all kv heads and keeps its own.
        replicate_kv = stored_kv_heads(cfg.num_kv_heads, tp) > cfg.num_kv_heads
        kv_parallel = REPLICATED if replicate_kv else COLUMN
        kv_bias_spec = (None,) if replicate_kv else (MODEL,)
        # q, k and v as one matmul (fused_layout.py), unless k/v are replicated while q is split
        self.fused_qkv = not replicate_kv
        if self.fused_qkv:
            self.qkv_proj = linear_weight(
                rngs, h, q + 2 * kv, dtype, COLUMN, quant, "self_attn.qkv_proj"
            )
        else:
            self.q_proj = linear_weight(rngs, h, q, dtype, COLUMN, quant, "self_attn.q_proj")
            self.k_proj = linear_weight(rngs, h, kv, dtype, kv_parallel, quant, "self_attn.k_proj")
            self.v_proj = linear_weight(rngs, h, kv, dtype, kv_parallel, quant, "self_attn.v_proj")
        self.o_proj = linear_weight(rngs, q, h, dtype, ROW, quant, "self_attn.o_proj")
        if cfg.attention_bias and self.fused_qkv:
            self.qkv_bias = param(rngs, (q + 2 * kv,), dtype, (MODEL,), init="zeros")
        elif cfg.attention_bias:
            self.q_bias = param(rngs, (q,), dtype, (MODEL,), init="zeros")
            self.k_bias = param(rngs, (kv,), dtype, kv_bias_spec, init="zeros")
            self.v_bias = param(rngs, (kv,), dtype, kv_bias_spec, init="zeros")
        self.has_bias = cfg.attention_bias
        self.sm_scale = d**-0.5
        self.backend = backend
        # Kernel schedule fields over each bucket's default (use_attention_tuning)
        self.tuning_overrides: TuningOverrides = ()

    def __call__(self, x, cos, sin, kv_pages, meta: AttentionInputs, kv_scales=None):
        """`kv_scales`: f32[2] (k_scale, v_scale) of fp8 pages; None: the default scales."""
        t, heads, kv_heads, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        if self.fused_qkv:
            qkv = linear(x, self.qkv_proj)
            if self.has_bias:
                qkv = qkv + self.qkv_bias[...]
            q, k, v = split_qkv(qkv, heads, kv_heads, d)
        else:
            q, k, v = linear(x, self.q_proj), linear(x, self.k_proj), linear(x, self.v_proj)
            if self.has_bias:
                q, k, v = q + self.q_bias[...], k + self.k_bias[...], v + self.v_bias[...]
            q, k, v = q.reshape(t, heads, d), k.reshape(t, kv_heads, d), v.reshape(t, kv_heads, d)
        q = apply_rope(q, cos, sin)  # [T, Hq, D]
        k = apply_rope(k, cos, sin)  # [T, Hkv, D]
        # The scope names the attention's ops in the compiled HLO: its loops (the reference's
        # page loop, a kernel's) are the only control flow the step may hold (test_step_hlo.py).
        args = (q, k, v, kv_pages, meta.slot_mapping, meta.kv_lens, meta.page_table)
        args += (meta.cu_q_lens, meta.distribution)
        with jax.named_scope(ATTENTION_SCOPE):
            kw = dict(sm_scale=self.sm_scale, backend=self.backend, kv_scales=kv_scales)
            kw["tuning_overrides"] = self.tuning_overrides
            if self.mesh is None:
                out, kv_pages = attention_step(*args, **kw)
            else:
                out, kv_pages = attention_step_sharded(*args, mesh=self.mesh, axis=MODEL, **kw)
        with jax.named_scope(O_PROJ_SCOPE):
            out = linear(out.reshape(t, self.num_heads * self.head_dim), self.o_proj)
        return out, kv_pages


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, quant: WeightQuantization | None):
        h, f = cfg.hidden_size, cfg.intermediate_size
        # gate and up as one matmul (fused_layout.py)
        self.gate_up_proj = linear_weight(rngs, h, 2 * f, dtype, COLUMN, quant, "mlp.gate_up_proj")
        self.down_proj = linear_weight(rngs, f, h, dtype, ROW, quant, "mlp.down_proj")

    def __call__(self, x: jax.Array) -> jax.Array:
        gate, up = split_gate_up(linear(x, self.gate_up_proj))
        gated = jax.nn.silu(gate) * up
        with jax.named_scope(DOWN_PROJ_SCOPE):
            return linear(gated, self.down_proj)


class DecoderLayer(nnx.Module):
    def __init__(
        self, cfg: ModelConfig, dtype, backend: str, rngs: nnx.Rngs, quant=None, mesh=None
    ):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, rngs)
        self.self_attn = Attention(cfg, dtype, backend, rngs, quant, mesh)
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
        mesh: Mesh | None = None,
        small_matmul: str = "xla",
        attention_tuning: TuningOverrides = (),
    ):
        """`quantization`: how the decoder's linear layers store their weights (None: float
        kernels in `dtype`); embeddings, LM head and norms stay in `dtype`. `mesh`: the mesh the
        parameters will live on (None: one device); its `model` axis splits the attention step.
        `small_matmul`: how quantized layers multiply in calls of few tokens (linear.py,
        SMALL_MATMULS); "pallas" (kernels) on one device only: XLA partitions a dot over the mesh,
        not a kernel call. `attention_tuning`: the Pallas attention kernel's schedule fields set
        over each bucket's default (use_attention_tuning)."""
        if small_matmul == "pallas" and mesh is not None and mesh.shape[MODEL] > 1:
            tp = mesh.shape[MODEL]
            raise ValueError(f"small_matmul='pallas' on a mesh of {tp=}: one device only")
        self.config = cfg
        self.embed_tokens = param(rngs, (cfg.vocab_size, cfg.hidden_size), dtype, (MODEL, None))
        self.layers = nnx.List(
            [
                DecoderLayer(cfg, dtype, attention_backend, rngs, quantization, mesh)
                for _ in range(cfg.num_layers)
            ]
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, rngs)
        if not cfg.tie_word_embeddings:
            self.lm_head = param(rngs, (cfg.hidden_size, cfg.vocab_size), dtype, (None, MODEL))
        use_small_matmul(self, small_matmul)
        use_attention_tuning(self, attention_tuning)

    def __call__(
        self,
        input_ids: jax.Array,  # int32[T]
        positions: jax.Array,  # int32[T]
        kv_pages: list[jax.Array],  # num_layers x [P, stored_kv_heads(Hkv, tp), 2, PS, D]
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


def use_attention_tuning(model: nnx.Module, overrides: TuningOverrides) -> None:
    """Set the Pallas attention kernel's schedule fields over each bucket's default in every
    attention layer (EngineConfig.attention_tuning; parsed by parse_tuning_overrides). The
    reference backend has no schedule and ignores them."""
    for _, node in nnx.iter_graph(model):
        if isinstance(node, Attention):
            node.tuning_overrides = tuple(overrides)
