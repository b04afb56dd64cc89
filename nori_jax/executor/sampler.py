"""Sampling on per-request arrays, with no data-dependent control flow (no host synchronization).

On XLA:GPU a `lax.cond` copies its predicate to the host and blocks, so the choice of work is made
on the host instead (core/sampling_modes.py): each step runs one static sampler program.

Per row (on logits that already carry the row's logit_bias, `add_logit_bias`):
  - temperature 0: the argmax;
  - otherwise Gumbel-max over logits / temperature, restricted, for rows that filter, to the
    tokens at or above the row's threshold: min-p first (tokens at least min_p times as likely
    as the most likely one, vLLM's order), then the k-th largest value for top-k, then the
    smallest value whose nucleus (mass of the strictly larger ones) stays below top_p, computed
    on the distribution renormalized over the tokens min-p and top-k keep. Thresholds come from
    the filtering rows gathered into a bucket of R rows, by one sort of each or by counting
    passes (filter_search.py); ties at the threshold are all kept.
The Gumbel noise of a row comes from a key derived from (request seed, output index): it does not
depend on the batch, and a preempted request that is recomputed draws the same tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from nori_jax.core.sampling_modes import SamplerProgram
from nori_jax.executor.filter_search import FORMS as FILTER_FORMS
from nori_jax.executor.filter_search import auto_form as auto_filter_form
from nori_jax.executor.filter_search import default_form as default_filter_form
from nori_jax.executor.filter_search import search_thresholds

_NEG_INF = -jnp.inf


def add_logit_bias(
    logits: jax.Array, rows: jax.Array, ids: jax.Array, values: jax.Array
) -> jax.Array:
    """logits [R, V] + each (row, token, bias) entry of the step (core/step_layout.py).

    Applied once, where the forward pass makes the logits (step_programs.py), so greedy rows,
    the sampler programs and the logprobs all see the biased logits, and the scatter can write the
    logits buffer in place: keeping the unbiased logits beside them would copy [R, V] (200 MB at
    1,024 rows x 49,152) every step. Unused entries add 0.0 (to row 0, token 0); entries of rows
    past R are dropped."""
    return logits.at[rows, ids].add(values, mode="drop")


def filter_thresholds(
    scaled: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    min_p: jax.Array,
    form: str | None = None,
) -> jax.Array:
    """float32[R]: each row's smallest kept value under min-p, top-k, then top-p: from one sort
    per row (`sort`) or from counting passes (`search`, executor/filter_search.py); the same
    threshold either way, but where float rounding differs at the top-p boundary itself.
    `form` None: `NORI_JAX_FILTER`'s; `auto` picks by the bucket's shape and the backend."""
    form = form or default_filter_form()
    if form not in FILTER_FORMS:
        raise ValueError(f"filter form {form!r} must be one of {FILTER_FORMS}")
    rows, vocab = scaled.shape
    if form == "auto":
        form = auto_filter_form(rows, vocab, jax.default_backend())
    # min-p: p >= min_p * p_max, i.e. scaled >= max + log(min_p) (-inf, no floor, for min_p 0).
    row_max = jnp.max(scaled, axis=-1)
    floor = row_max + jnp.log(min_p)
    scaled = jnp.where(scaled >= floor[:, None], scaled, _NEG_INF)
    if form != "sort":
        siblings = form == "search_siblings"
        threshold = search_thresholds(scaled, top_k, top_p, row_max, siblings=siblings)
        return jnp.maximum(threshold, floor)
    sorted_desc = -jnp.sort(-scaled, axis=-1)  # [R, V]
    ranks = jnp.arange(vocab)[None, :]
    in_k = ranks < jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)[:, None]
    probs = jax.nn.softmax(jnp.where(in_k, sorted_desc, _NEG_INF), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    # A token stays while the mass strictly before it is below top_p, so the most likely one
    # always stays; top_p = 1 keeps the whole set even where rounding lets that mass reach 1.
    keep = in_k & ((mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0))
    num_keep = jnp.maximum(keep.sum(axis=-1), 1)
    threshold = jnp.take_along_axis(sorted_desc, (num_keep - 1)[:, None], axis=-1)[:, 0]
    return jnp.maximum(threshold, floor)  # a set that keeps every token still keeps min-p's


def _gumbel(seeds: jax.Array, sample_index: jax.Array, vocab: int) -> jax.Array:
    """float32[S, V]: each row's noise, from its (seed, output index) alone."""
    keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(seeds, sample_index)
    return jax.vmap(lambda k: jax.random.gumbel(k, (vocab,), jnp.float32))(keys)


def sample(
    logits: jax.Array,  # float32[S, V]
    temperature: jax.Array,  # float32[S]; 0 = greedy
    top_p: jax.Array,  # float32[S]
    top_k: jax.Array,  # int32[S]; 0 = off (normalize_top_k)
    min_p: jax.Array,  # float32[S]; 0 = off
    seeds: jax.Array,  # int32[S]
    sample_index: jax.Array,  # int32[S]
    filter_rows: jax.Array,  # int32[S]: rows to filter first, then S (padding)
    *,
    program: SamplerProgram,
) -> tuple[jax.Array, jax.Array]:
    """(tokens int32[S], each token's logprob under the unscaled distribution of `logits`, with
    their logit_bias if any, float32[S]).

    `program` is static (one compiled program each) and must come from `choose_program` over the
    same rows: a filtering row outside `filter_rows` would be sampled unfiltered.
    """
    logits = logits.astype(jnp.float32)
    s, vocab = logits.shape
    tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if program.kind != "greedy":
        is_random = temperature > 0.0
        scaled = logits / jnp.where(is_random, temperature, 1.0)[:, None]
        if program.kind == "filter":
            rows = filter_rows[: program.filter_rows]
            thresholds = filter_thresholds(
                jnp.take(scaled, rows, axis=0, mode="clip"),
                jnp.take(top_k, rows, mode="clip"),
                jnp.take(top_p, rows, mode="clip"),
                jnp.take(min_p, rows, mode="clip"),
            )
            per_row = jnp.full(s, _NEG_INF).at[rows].set(thresholds, mode="drop")
            scaled = jnp.where(scaled >= per_row[:, None], scaled, _NEG_INF)
        noise = _gumbel(seeds, sample_index, vocab)
        drawn = jnp.argmax(scaled + noise, axis=-1).astype(jnp.int32)
        tokens = jnp.where(is_random, drawn, tokens)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    logprobs = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0] - log_z
    return tokens, logprobs
