"""Pure-jnp ragged paged attention: the definition, the CPU path, and the oracle for the kernels.

Inputs (S sequences, T tokens, P pages, MP pages per sequence):

    q            [T, Hq, D]            the step's queries, sequences laid end to end
    kv_pages     [P, Hkv, 2, PS, D]    one layer's pages (kv_layout), holding this step's K/V
    kv_lens      int32[S]              tokens in each sequence's cache, this step's included
    page_table   int32[S, MP]          page ids per sequence; unused entries: any valid page
    cu_q_lens    int32[S + 1]          query offsets; sequence s owns tokens
                                       [cu_q_lens[s], cu_q_lens[s+1])
    distribution int32[2]              (num_decode_seqs, num_seqs): sequences [0, d) have one query
                                       token each, [d, n) are prefill chunks, [n, S) are padding
    kv_scales    f32[2] or None        (k_scale, v_scale) of fp8 pages (kv_layout.py; None: the
                                       default scales); None for other pages

Query token i of sequence s sits at position kv_lens[s] - q_len[s] + i and attends causally to the
cached positions [0, that position]. Tokens past cu_q_lens[num_seqs] are padding: output 0.

The loop runs over page slots j, gathering for every token the j-th page of its own sequence,
with an online softmax. Memory per iteration is T * Hkv * PS * D, whatever the context length;
the cost is T * max_pages page reads, which is why the kernels exist.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.kv_layout import (
    K_INDEX,
    V_INDEX,
    default_kv_scales,
    dequantize_kv,
    is_fp8,
    split_kv,
)
from pallas_kernels.ragged_paged_attention.validate import check_inputs

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def token_metadata(
    kv_lens: jax.Array, cu_q_lens: jax.Array, distribution: jax.Array, num_tokens: int
):
    """Per-token sequence id, query position and validity (shared with the kernels' wrappers)."""
    num_seqs = distribution[1]
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    # compare_all: one fused reduction; the default method is an XLA while loop (schedule.py).
    seq_ids = jnp.searchsorted(cu_q_lens[1:], t, side="right", method="compare_all")
    seq_ids = seq_ids.astype(jnp.int32)
    seq_ids = jnp.minimum(seq_ids, kv_lens.shape[0] - 1)
    valid = t < cu_q_lens[num_seqs]
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    q_pos = kv_lens[seq_ids] - q_lens[seq_ids] + (t - cu_q_lens[seq_ids])
    return seq_ids, jnp.where(valid, q_pos, -1), valid


def quantize_query_rows(q: jax.Array, dtype) -> jax.Array:
    """q [T, Hq, D] as the kernel reads it with tuning.fp8_qk (e4m3 pages' decode buckets by
    default): each (token, head) row over its absmax scale, rounded to the fp8 `dtype`, and back
    in q's dtype. Run the reference on it to check such a kernel call."""
    q32 = q.astype(jnp.float32)
    top = float(jnp.finfo(dtype).max)
    scale = jnp.maximum(jnp.abs(q32).max(axis=-1, keepdims=True), 1e-30) / top
    return ((q32 / scale).astype(dtype).astype(jnp.float32) * scale).astype(q.dtype)


# Q rows in fp8 (tuning.fp8_qk, on e4m3 and e5m2 pages alike): e4m3, whose three mantissa bits cost
# the embedded model little where e5m2's two cost 6% perplexity; wgmma multiplies it with either K.
QUERY_DTYPE = jnp.float8_e4m3fn

# P V on fp8 pages (mgpu_consumer.py): the kernel rounds P = exp(s - running max), in [0, 1], to
# float8_e4m3fn after scaling it by 2^PROBS_LOG2_SCALE, so that its smallest values stay normal
# numbers (e4m3's normal range starts at 2^-6); the scale cancels in O / denominator.
PROBS_DTYPE = jnp.float8_e4m3fn
PROBS_LOG2_SCALE = 8


def quantize_probs(p: jax.Array) -> jax.Array:
    """Softmax numerators p in [0, 1] as P V on fp8 pages reads them (PROBS_DTYPE after scaling by
    2^PROBS_LOG2_SCALE), back in float32 and unscaled."""
    scale = float(2**PROBS_LOG2_SCALE)
    return (p * scale).astype(PROBS_DTYPE).astype(jnp.float32) * (1.0 / scale)


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "fp8_probs"))
def ragged_paged_attention_reference(
    q: jax.Array,
    kv_pages: jax.Array,
    kv_lens: jax.Array,
    page_table: jax.Array,
    cu_q_lens: jax.Array,
    distribution: jax.Array,
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    kv_scales: jax.Array | None = None,
    fp8_probs: bool = False,
) -> jax.Array:
    """fp8_probs: P V reads the softmax numerators rounded as the kernel rounds them on fp8 pages
    (quantize_probs; the denominators stay float32, as the kernel's do). The kernel's running max
    moves block by block and this one page by page, so the rounding grids match only where both
    have seen the row's largest score: close, not bit-equal."""
    check_inputs(q, kv_pages, kv_lens, page_table, cu_q_lens, distribution, kv_scales)
    if is_fp8(kv_pages.dtype) and kv_scales is None:
        kv_scales = default_kv_scales()
    num_tokens, hq, d = q.shape
    _, hkv, _, page_size, _ = kv_pages.shape
    group = hq // hkv
    seq_ids, q_pos, valid = token_metadata(kv_lens, cu_q_lens, distribution, num_tokens)
    qg = q.astype(jnp.float32).reshape(num_tokens, hkv, group, d) * sm_scale  # [T, K, G, D]
    token_kv_len = jnp.where(valid, kv_lens[seq_ids], 0)  # [T]
    num_page_slots = (jnp.max(token_kv_len) + page_size - 1) // page_size

    def body(carry):
        j, m, denom, acc = carry
        pages = page_table[seq_ids, j]  # [T]
        k, v = split_kv(kv_pages[pages])  # [T, K, PS, D] each
        if kv_scales is None:
            k, v = k.astype(jnp.float32), v.astype(jnp.float32)
        else:  # fp8 pages: dequantized on the fly
            k, v = dequantize_kv(k, kv_scales[K_INDEX]), dequantize_kv(v, kv_scales[V_INDEX])
        s = jnp.einsum("tkgd,tkpd->tkgp", qg, k)
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        key_pos = j * page_size + jnp.arange(page_size, dtype=jnp.int32)  # [PS]
        mask = (key_pos[None, :] <= q_pos[:, None]) & (key_pos[None, :] < token_kv_len[:, None])
        s = jnp.where(mask[:, None, None, :], s, MASK_VALUE)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.exp(s - m_new[..., None])
        p = jnp.where(mask[:, None, None, :], p, 0.0)
        alpha = jnp.exp(m - m_new)
        denom_new = alpha * denom + p.sum(axis=-1)
        p_v = quantize_probs(p) if fp8_probs else p
        acc_new = alpha[..., None] * acc + jnp.einsum("tkgp,tkpd->tkgd", p_v, v)
        return j + 1, m_new, denom_new, acc_new

    init = (
        jnp.int32(0),
        jnp.full((num_tokens, hkv, group), MASK_VALUE, jnp.float32),
        jnp.zeros((num_tokens, hkv, group), jnp.float32),
        jnp.zeros((num_tokens, hkv, group, d), jnp.float32),
    )
    _, _, denom, acc = jax.lax.while_loop(lambda c: c[0] < num_page_slots, body, init)
    out = acc / jnp.where(denom == 0.0, 1.0, denom)[..., None]
    out = jnp.where(valid[:, None, None, None], out, 0.0)
    return out.reshape(num_tokens, hq, d).astype(q.dtype)
