"""Presence, frequency and repetition penalties, from token counts the device keeps between steps.

A request with a penalty holds a penalty place while it runs (core/step_room.py); the device keeps,
per place, how many times each token was generated (`counts` int32[P, V]) and which tokens its
prompt holds (`in_prompt` bool[P, V]). The host never sends a request's history: each step the
counts grow on the device from what passes through it.

    record_step_tokens   before the penalties of a step (program `penalize`): a place whose
                         request is new is cleared; then each token of the place's row marks
                         `in_prompt` (a position inside the prompt) or, for the outputs a resumed
                         request recomputes (positions in [prompt_len, count_from)), adds a count.
    apply_penalties      then, on the logits of the places' rows, vLLM's formulas.
    count_samples        after the sampler (program `count`): each place whose row sampled adds
                         its new token.

So every output token is counted exactly once: when sampled, or, after a preemption gave the
place back, when its recomputation passes through the step of the place taken on resuming. The
prefix cache would skip tokens, so a request that needs them takes no cached pages
(`Request.reads_prefix_cache`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from nori_jax.core.step_layout import PENALTY_FRESH, PENALTY_SAMPLES


def _drop_unless(keep: jax.Array, index: jax.Array, out_of_range: int) -> jax.Array:
    """`index` where `keep`, else an index every scatter with mode="drop" ignores."""
    return jnp.where(keep, index, out_of_range)


def record_step_tokens(
    counts: jax.Array,  # int32[P, V]
    in_prompt: jax.Array,  # bool[P, V]
    row: dict[str, jax.Array],  # the step's per-row fields (executor/step_inputs.py)
    input_ids: jax.Array,  # int32[C]: the step's token ids (all the token room)
    positions: jax.Array,  # int32[C]
) -> tuple[jax.Array, jax.Array]:
    places, s = counts.shape[0], row["cu_q_lens"].shape[0] - 1
    place_ids = jnp.arange(places, dtype=jnp.int32)
    fresh = (row["penalty_flags"] & PENALTY_FRESH) != 0
    cleared = _drop_unless(fresh, place_ids, places)
    counts = counts.at[cleared].set(0, mode="drop")
    in_prompt = in_prompt.at[cleared].set(False, mode="drop")
    # Each token's row: how many rows end at or before it (cu_q_lens: row i's tokens are
    # [cu[i], cu[i+1]); tokens past the step's last row count S), then that row's place (P:
    # none). A cumulative sum, not a search: no loop in the program.
    ends = jnp.zeros(input_ids.shape[0], jnp.int32).at[row["cu_q_lens"][1:]].add(1, mode="drop")
    token_row = jnp.cumsum(ends)
    row_place = jnp.full(s + 1, places, jnp.int32).at[row["penalty_rows"]].set(place_ids)
    row_place = row_place.at[s].set(places)  # unused places point at row S
    place = row_place[token_row]
    prompt_len = row["penalty_prompt_len"][jnp.minimum(place, places - 1)]
    count_from = row["penalty_count_from"][jnp.minimum(place, places - 1)]
    used = place < places
    is_prompt = used & (positions < prompt_len)
    recounted = used & (positions >= prompt_len) & (positions < count_from)
    in_prompt = in_prompt.at[_drop_unless(is_prompt, place, places), input_ids].set(
        True, mode="drop"
    )
    counts = counts.at[_drop_unless(recounted, place, places), input_ids].add(1, mode="drop")
    return counts, in_prompt


def apply_penalties(
    logits: jax.Array,  # float32[S, V]
    counts: jax.Array,  # int32[P, V]
    in_prompt: jax.Array,  # bool[P, V]
    row: dict[str, jax.Array],
) -> jax.Array:
    """The logits with each place's row penalized, vLLM's order: repetition (a token of the prompt
    or the output: a positive logit divided by it, a negative one multiplied), then frequency
    (times the token's count) and presence (once for a generated token) subtracted."""
    s = logits.shape[0]
    rows = row["penalty_rows"]  # S where unused: gathered clipped, dropped on the way back
    picked = logits[jnp.minimum(rows, s - 1)]  # [P, V]
    generated = counts > 0
    rep = row["repetition_penalty"][:, None]
    seen = in_prompt | generated
    picked = jnp.where(seen, jnp.where(picked > 0, picked / rep, picked * rep), picked)
    picked = picked - row["frequency_penalty"][:, None] * counts.astype(jnp.float32)
    picked = picked - row["presence_penalty"][:, None] * generated.astype(jnp.float32)
    return logits.at[rows].set(picked, mode="drop")


def count_samples(counts: jax.Array, tokens: jax.Array, row: dict[str, jax.Array]) -> jax.Array:
    """`counts` plus each sampled token (`tokens` int32[S]: the step's samples) of the places
    whose row sampled in this step."""
    places, s = counts.shape[0], tokens.shape[0]
    samples = (row["penalty_flags"] & PENALTY_SAMPLES) != 0
    place = _drop_unless(samples, jnp.arange(places, dtype=jnp.int32), places)
    return counts.at[place, tokens[jnp.minimum(row["penalty_rows"], s - 1)]].add(1, mode="drop")
