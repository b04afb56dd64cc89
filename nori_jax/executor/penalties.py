"""Presence, frequency and repetition penalties, from token counts the device keeps between steps.

The device keeps, per slot of the batch, how many times each token was generated (`counts`
int32[S, V]) and which tokens the prompt holds (`in_prompt` bool[S, V]): 250 MB at 1,024 slots
of SmolLM2's 49,152 tokens. The host never sends a request's history: the counts grow on the
device from what passes through each step. A step lists its rows whose request has a penalty
first in its penalty fields (core/step_layout.py); a program for a bucket of B such rows
(`sampling_modes.filter_buckets`) touches B rows of the tables and the logits, not the batch.

    record_step_tokens   before the penalties of a step (program `penalties (B rows)`): a slot
                         whose request is new is cleared, then marked with the ids of the prompt
                         tokens it took from the prefix cache (`penalty_mark_tokens`); then each
                         token of a listed row marks
                         `in_prompt` (a position inside the prompt) or, for the outputs a resumed
                         request recomputes (positions in [prompt_len, count_from)), adds a count.
    apply_penalties      then, on the listed rows' logits, vLLM's formulas.
    count_samples        after the sampler (program `penalty counts`): each listed row that
                         sampled adds its new token.

So every output token is counted exactly once: when sampled, or, after a preemption freed the
slot, when its recomputation passes through the step in the slot taken on resuming. The prefix
cache would skip tokens: a new request's cached prompt tokens come as marks in its first step
(PENALTY_MARKS for a step's admissions), and a resumed request, whose outputs are recounted as they
are recomputed, reads no cached pages (`Request.reads_prefix_cache`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from nori_jax.core.step_layout import PENALTY_FRESH, PENALTY_SAMPLES


def record_step_tokens(
    counts: jax.Array,  # int32[S, V]
    in_prompt: jax.Array,  # bool[S, V]
    row: dict[str, jax.Array],  # the step's per-row fields (executor/step_inputs.py)
    input_ids: jax.Array,  # int32[C]: the step's token ids (all the token room)
    positions: jax.Array,  # int32[C]
    num_listed: int,  # B: the penalty fields' first B entries (the rest are padding)
) -> tuple[jax.Array, jax.Array]:
    s = counts.shape[0]  # also the padding value of rows and slots: dropped by every scatter
    rows, slots = row["penalty_rows"][:num_listed], row["penalty_slots"][:num_listed]
    fresh = (row["penalty_flags"][:num_listed] & PENALTY_FRESH) != 0
    cleared = jnp.where(fresh, slots, s)
    counts = counts.at[cleared].set(0, mode="drop")
    in_prompt = in_prompt.at[cleared].set(False, mode="drop")
    # The cached prompt tokens of new requests (they pass through no step): after the clear.
    marked = row["penalty_mark_entries"]  # each mark's entry in the list
    mark_slot = jnp.where(marked < num_listed, slots[jnp.minimum(marked, num_listed - 1)], s)
    in_prompt = in_prompt.at[mark_slot, row["penalty_mark_tokens"]].set(True, mode="drop")
    # Each token's row: how many rows end at or before it (cu_q_lens: row i's tokens are
    # [cu[i], cu[i+1]); tokens past the step's last row count S). A cumulative sum, not a
    # search: no loop in the program. Then the row's entry in the list (B: none).
    ends = jnp.zeros(input_ids.shape[0], jnp.int32).at[row["cu_q_lens"][1:]].add(1, mode="drop")
    token_row = jnp.cumsum(ends)
    row_entry = jnp.full(s + 1, num_listed, jnp.int32)
    # (Padding entries write row S, which tokens past the step's rows read: their slot is S too,
    # so whatever they mark is dropped.)
    row_entry = row_entry.at[rows].set(jnp.arange(num_listed, dtype=jnp.int32))
    entry = row_entry[token_row]  # int32[C]
    pad = lambda x, v: jnp.concatenate([x, jnp.full(1, v, x.dtype)])  # noqa: E731 - entry B
    slot = pad(slots, s)[entry]
    prompt_len = pad(row["penalty_prompt_len"][:num_listed], 0)[entry]
    count_from = pad(row["penalty_count_from"][:num_listed], 0)[entry]
    is_prompt = positions < prompt_len
    recounted = (positions >= prompt_len) & (positions < count_from)
    in_prompt = in_prompt.at[jnp.where(is_prompt, slot, s), input_ids].set(True, mode="drop")
    counts = counts.at[jnp.where(recounted, slot, s), input_ids].add(1, mode="drop")
    return counts, in_prompt


def apply_penalties(
    logits: jax.Array,  # float32[S, V]
    counts: jax.Array,  # int32[S, V]
    in_prompt: jax.Array,  # bool[S, V]
    row: dict[str, jax.Array],
    num_listed: int,
) -> jax.Array:
    """The logits with each listed row penalized, vLLM's order: repetition (a token of the prompt
    or the output: a positive logit divided by it, a negative one multiplied), then frequency
    (times the token's count) and presence (once for a generated token) subtracted."""
    s = logits.shape[0]
    rows = row["penalty_rows"][:num_listed]  # S where unused: gathered clipped, then dropped
    slots = jnp.minimum(row["penalty_slots"][:num_listed], s - 1)
    picked = logits[jnp.minimum(rows, s - 1)]  # [B, V]
    count = counts[slots]
    generated = count > 0
    rep = row["repetition_penalty"][:num_listed, None]
    seen = in_prompt[slots] | generated
    picked = jnp.where(seen, jnp.where(picked > 0, picked / rep, picked * rep), picked)
    picked = picked - row["frequency_penalty"][:num_listed, None] * count.astype(jnp.float32)
    picked = picked - row["presence_penalty"][:num_listed, None] * generated.astype(jnp.float32)
    return logits.at[rows].set(picked, mode="drop")


def count_samples(counts: jax.Array, tokens: jax.Array, row: dict[str, jax.Array]) -> jax.Array:
    """`counts` plus each sampled token (`tokens` int32[S]: the step's samples) of the listed
    rows that sampled in this step."""
    s = counts.shape[0]
    samples = (row["penalty_flags"] & PENALTY_SAMPLES) != 0
    slots = jnp.where(samples, row["penalty_slots"], s)
    return counts.at[slots, tokens[jnp.minimum(row["penalty_rows"], s - 1)]].add(1, mode="drop")
