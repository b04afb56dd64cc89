"""Sampling inside the jitted step, on per-request arrays: no setting here ever recompiles.

Greedy rows take the argmax. Random rows scale by temperature, optionally keep the top-k / top-p
set (one full sort, taken only when some row asks for it, via lax.cond), and sample with the Gumbel
trick from a key derived from (request seed, output index): a request's tokens depend on its seed
alone, not on what it is batched with or whether it was preempted and recomputed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_NEG_INF = -jnp.inf


def _top_k_top_p_mask(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """logits float32[S, V] with entries outside each row's top-k / top-p set at -inf."""
    vocab = logits.shape[-1]
    sorted_desc = -jnp.sort(-logits, axis=-1)  # [S, V]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)  # [S]
    ranks = jnp.arange(vocab)[None, :]
    sorted_desc = jnp.where(ranks < k[:, None], sorted_desc, _NEG_INF)
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    # Keep a token while the mass strictly before it is below top_p (so the first one always stays).
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = (mass_before < top_p[:, None]) & (ranks < k[:, None])
    num_keep = jnp.maximum(keep.sum(axis=-1), 1)
    threshold = jnp.take_along_axis(sorted_desc, (num_keep - 1)[:, None], axis=-1)  # [S, 1]
    return jnp.where(logits >= threshold, logits, _NEG_INF)


def sample(
    logits: jax.Array,  # float32[S, V]
    temperature: jax.Array,  # float32[S]; 0 = greedy
    top_p: jax.Array,  # float32[S]
    top_k: jax.Array,  # int32[S]; 0 = off
    seeds: jax.Array,  # int32[S]
    sample_index: jax.Array,  # int32[S]
) -> tuple[jax.Array, jax.Array]:
    """(tokens int32[S], each token's logprob under the unscaled distribution float32[S])."""
    greedy_tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    is_random = temperature > 0.0

    def random_tokens() -> jax.Array:
        scaled = logits / jnp.where(is_random, temperature, 1.0)[:, None]
        needs_filter = jnp.any(is_random & ((top_k > 0) | (top_p < 1.0)))
        scaled = jax.lax.cond(
            needs_filter, lambda x: _top_k_top_p_mask(x, top_k, top_p), lambda x: x, scaled
        )
        keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(seeds, sample_index)
        gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (logits.shape[-1],), jnp.float32))(keys)
        drawn = jnp.argmax(scaled + gumbel, axis=-1).astype(jnp.int32)
        return jnp.where(is_random, drawn, greedy_tokens)

    tokens = jax.lax.cond(jnp.any(is_random), random_tokens, lambda: greedy_tokens)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    logprobs = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0] - log_z
    return tokens, logprobs
