"""The device side of penalties (executor/penalties.py) on hand-made step buffers, against
vLLM's formulas written out in numpy: a new request's slot cleared, prompt tokens marked,
recomputed outputs recounted, sampled tokens counted, only the listed rows of the logits changed,
and a bucket larger than the list the same as one that fits it."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from nori_jax.core.step_layout import PENALTY_FRESH, PENALTY_SAMPLES, StepLayout
from nori_jax.executor.penalties import apply_penalties, count_samples, record_step_tokens
from nori_jax.executor.step_inputs import unpack_rows, unpack_tokens

S, V = 6, 40
LAYOUT = StepLayout(max_num_seqs=S, max_pages_per_seq=4, max_num_batched_tokens=32)


def _step(rows: list[list[tuple[int, int]]]) -> np.ndarray:
    """A step buffer whose row i holds the (position, token id) pairs rows[i]."""
    buf = LAYOUT.new_step()
    tokens = LAYOUT.tokens(buf)
    cu = LAYOUT.view(buf, "cu_q_lens")
    n = 0
    for i, pairs in enumerate(rows):
        for pos, tok in pairs:
            tokens[0, n], tokens[1, n] = tok, pos
            n += 1
        cu[i + 1] = n
    cu[len(rows) + 1 :] = n
    return buf


FIELDS = {
    "row": "penalty_rows",
    "slot": "penalty_slots",
    "flags": "penalty_flags",
    "prompt_len": "penalty_prompt_len",
    "count_from": "penalty_count_from",
    "presence": "presence_penalty",
    "frequency": "frequency_penalty",
    "repetition": "repetition_penalty",
}


def _list(buf, entries: list[dict]) -> None:
    """Write the step's listed penalty rows (dicts keyed by FIELDS' short names)."""
    for j, e in enumerate(entries):
        for name, value in e.items():
            LAYOUT.view(buf, FIELDS[name])[j] = value


@pytest.mark.parametrize("bucket", [3, S])  # the list's length, or the padding past it too
def test_record_clears_new_slots_marks_prompts_and_recounts_recomputed_outputs(bucket):
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 3, (S, V)).astype(np.int32)
    in_prompt = rng.random((S, V)) < 0.3
    # Row 0: a decode row in slot 5 (position 9, past its count_from: counted when sampled).
    # Row 1: no penalty. Row 2: slot 3, a new request (fresh) recomputing after a preemption: a
    # prompt of 4 tokens, then 3 outputs already generated (count_from 7), positions 0..6.
    # Row 3: slot 1, a prompt chunk at positions 4..5 of a 10-token prompt.
    buf = _step(
        [
            [(9, 11)],
            [(0, 12), (1, 13)],
            [(0, 1), (1, 2), (2, 1), (3, 4), (4, 2), (5, 2), (6, 30)],
            [(4, 20), (5, 21)],
        ]
    )
    _list(
        buf,
        [
            dict(row=0, slot=5, prompt_len=3, count_from=8),
            dict(row=2, slot=3, flags=PENALTY_FRESH, prompt_len=4, count_from=7),
            dict(row=3, slot=1, prompt_len=10, count_from=10),
        ],
    )
    # Entry 1 (slot 3, new) took its first tokens from the prefix cache: their ids come as marks,
    # set after the clear; a mark of an entry past the bucket (5) or unused (S) changes nothing.
    marks = [(1, 7), (1, 8), (5, 9), (S, 10)]
    LAYOUT.view(buf, "penalty_mark_entries")[: len(marks)] = [e for e, _ in marks]
    LAYOUT.view(buf, "penalty_mark_tokens")[: len(marks)] = [t for _, t in marks]
    step = jnp.asarray(buf)
    row = unpack_rows(LAYOUT, step)
    tok = unpack_tokens(LAYOUT, step, LAYOUT.token_capacity)
    c, p = record_step_tokens(
        jnp.asarray(counts), jnp.asarray(in_prompt), row, tok["input_ids"], tok["positions"], bucket
    )
    expected_c, expected_p = counts.copy(), in_prompt.copy()
    expected_c[3], expected_p[3] = 0, False
    expected_p[3, [1, 2, 4]] = True  # its prompt
    expected_p[3, [7, 8]] = True  # its marks
    expected_c[3, 2] += 2  # its recomputed outputs: 2, 2, 30
    expected_c[3, 30] += 1
    expected_p[1, [20, 21]] = True
    np.testing.assert_array_equal(np.asarray(c), expected_c)
    np.testing.assert_array_equal(np.asarray(p), expected_p)


@pytest.mark.parametrize("bucket", [2, S])
def test_penalties_follow_vllms_formulas_on_the_listed_rows_only(bucket):
    rng = np.random.default_rng(1)
    logits = rng.normal(0, 3, (S, V)).astype(np.float32)
    counts = np.zeros((S, V), np.int32)
    in_prompt = np.zeros((S, V), bool)
    counts[2, [3, 4, 5]] = [1, 2, 4]
    in_prompt[2, [4, 9, 10]] = True
    counts[0, 0] = 3
    buf = LAYOUT.new_step()
    LAYOUT.view(buf, "repetition_penalty")[:] = 1.0
    # row 4 in slot 2; row 1 in slot 0
    _list(
        buf,
        [
            dict(row=4, slot=2, presence=0.5, frequency=0.25, repetition=1.7),
            dict(row=1, slot=0, presence=-1.0, frequency=0.0, repetition=1.0),
        ],
    )
    row = unpack_rows(LAYOUT, jnp.asarray(buf))
    out = np.asarray(apply_penalties(jnp.asarray(logits), counts, in_prompt, row, bucket))

    expected = logits.copy()
    for slot, r, pres, freq, rep in ((2, 4, 0.5, 0.25, 1.7), (0, 1, -1.0, 0.0, 1.0)):
        x = expected[r]
        seen = in_prompt[slot] | (counts[slot] > 0)
        x = np.where(seen, np.where(x > 0, x / rep, x * rep), x)
        expected[r] = x - freq * counts[slot] - pres * (counts[slot] > 0)
    np.testing.assert_allclose(out, expected, rtol=1e-6)
    assert not np.array_equal(out[4], logits[4]) and not np.array_equal(out[1], logits[1])
    np.testing.assert_array_equal(out[[0, 2, 3, 5]], logits[[0, 2, 3, 5]])  # not listed


def test_only_the_listed_rows_that_sampled_count_their_token():
    counts = np.zeros((S, V), np.int32)
    buf = LAYOUT.new_step()
    _list(
        buf,
        [
            dict(row=2, slot=0, flags=PENALTY_SAMPLES),
            dict(row=3, slot=1, flags=0),  # a prefill chunk that ends before its prompt does
            dict(row=0, slot=4, flags=PENALTY_SAMPLES | PENALTY_FRESH),
        ],
    )
    tokens = jnp.asarray(np.array([7, 8, 9, 10, 11, 12], np.int32))
    out = count_samples(jnp.asarray(counts), tokens, unpack_rows(LAYOUT, jnp.asarray(buf)))
    expected = counts.copy()
    expected[0, 9] = expected[4, 7] = 1
    np.testing.assert_array_equal(np.asarray(out), expected)
