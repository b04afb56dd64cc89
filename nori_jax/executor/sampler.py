"""Sampling on per-request arrays, with no data-dependent control flow (no host synchronization).

On XLA:GPU a `lax.cond` copies its predicate to the host and blocks, so the choice of work is made
on the host instead: each step picks one of a few static sampler programs (`SamplerMode`) from the
scheduled rows' settings, which the host already knows. Within a program every row runs the same
ops and selects its result with `where`.

Which computation a row gets depends on its own settings only, never on its neighbours or the
mode, so a request's tokens are a function of its logits, its settings and its seed:
  - temperature 0: the argmax;
  - no filter (top_k off, top_p 1): Gumbel-max over the whole vocabulary;
  - top_k in [1, cap]: top-k through `lax.top_k` with the static cap, then top-p inside that set;
  - anything wider (top_p < 1 without top_k, or top_k > cap): the exact full-vocabulary filter,
    one sort per row, present only in the FULL program.
The Gumbel noise of a row comes from a key derived from (request seed, output index): it does not
depend on the batch, and a preempted request that is recomputed draws the same tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from nori_jax.core.sampling_modes import (
    DEFAULT_TOP_K_CAP,
    SamplerMode,
    needs_full_filter,
    uses_capped_filter,
)

_NEG_INF = -jnp.inf


def _nucleus(sorted_desc: jax.Array, k: jax.Array, top_p: jax.Array) -> jax.Array:
    """bool[S, N]: which entries of each row's descending values are kept by top-k then top-p.

    Top-p works on the distribution renormalized over the top-k set; a token stays while the mass
    strictly before it is below top_p, so the most likely token always stays.
    """
    ranks = jnp.arange(sorted_desc.shape[-1])[None, :]
    in_k = ranks < k[:, None]
    probs = jax.nn.softmax(jnp.where(in_k, sorted_desc, _NEG_INF), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    # top_p == 1 keeps the whole set even where rounding lets the mass before a token reach 1.
    return in_k & ((mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0))


def _full_filter(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """float32[S, V]: `scaled` with entries outside each row's top-k / top-p set at -inf (exact,
    one full sort per row)."""
    vocab = scaled.shape[-1]
    sorted_desc = -jnp.sort(-scaled, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    keep = _nucleus(sorted_desc, k, top_p)
    num_keep = jnp.maximum(keep.sum(axis=-1), 1)
    threshold = jnp.take_along_axis(sorted_desc, (num_keep - 1)[:, None], axis=-1)  # [S, 1]
    return jnp.where(scaled >= threshold, scaled, _NEG_INF)


def _gumbel(seeds: jax.Array, sample_index: jax.Array, vocab: int) -> jax.Array:
    """float32[S, V]: each row's noise, from its (seed, output index) alone."""
    keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(seeds, sample_index)
    return jax.vmap(lambda k: jax.random.gumbel(k, (vocab,), jnp.float32))(keys)


def sample(
    logits: jax.Array,  # float32[S, V]
    temperature: jax.Array,  # float32[S]; 0 = greedy
    top_p: jax.Array,  # float32[S]
    top_k: jax.Array,  # int32[S]; 0 = off (normalize_top_k)
    seeds: jax.Array,  # int32[S]
    sample_index: jax.Array,  # int32[S]
    *,
    mode: SamplerMode,
    top_k_cap: int = DEFAULT_TOP_K_CAP,
) -> tuple[jax.Array, jax.Array]:
    """(tokens int32[S], each token's logprob under the unscaled distribution float32[S]).

    `mode` is static (one compiled program per mode) and must come from `choose_mode` over the
    same rows; rows that need more than the mode provides would be sampled unfiltered.
    """
    logits = logits.astype(jnp.float32)
    vocab = logits.shape[-1]
    tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if mode != SamplerMode.GREEDY:
        cap = min(top_k_cap, vocab)
        is_random = temperature > 0.0
        scaled = logits / jnp.where(is_random, temperature, 1.0)[:, None]
        noise = _gumbel(seeds, sample_index, vocab)
        drawn = jnp.argmax(scaled + noise, axis=-1).astype(jnp.int32)  # no filter

        values, ids = jax.lax.top_k(scaled, cap)  # [S, C], descending
        keep = _nucleus(values, jnp.where(top_k > 0, top_k, cap), top_p)
        noisy = jnp.where(keep, values + jnp.take_along_axis(noise, ids, axis=-1), _NEG_INF)
        pick = jnp.argmax(noisy, axis=-1)[:, None]
        capped = jnp.take_along_axis(ids, pick, axis=-1)[:, 0].astype(jnp.int32)
        drawn = jnp.where(uses_capped_filter(top_p, top_k, cap, vocab), capped, drawn)

        if mode == SamplerMode.FULL:
            filtered = _full_filter(scaled, top_k, top_p)
            full = jnp.argmax(filtered + noise, axis=-1).astype(jnp.int32)
            drawn = jnp.where(needs_full_filter(top_p, top_k, cap, vocab), full, drawn)
        tokens = jnp.where(is_random, drawn, tokens)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    logprobs = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0] - log_z
    return tokens, logprobs
