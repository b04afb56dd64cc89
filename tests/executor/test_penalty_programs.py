"""The device side of penalties (executor/penalties.py) on hand-made step buffers, against
vLLM's formulas written out in numpy: places cleared when fresh, prompt tokens marked, recomputed
outputs recounted, sampled tokens counted, and only the places' rows of the logits changed."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from nori_jax.core.step_layout import PENALTY_FRESH, PENALTY_PLACES, PENALTY_SAMPLES, StepLayout
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


def _record(buf, counts, in_prompt):
    step = jnp.asarray(buf)
    row = unpack_rows(LAYOUT, step)
    tok = unpack_tokens(LAYOUT, step, LAYOUT.token_capacity)
    c, p = record_step_tokens(
        jnp.asarray(counts), jnp.asarray(in_prompt), row, tok["input_ids"], tok["positions"]
    )
    return np.asarray(c), np.asarray(p), row


def test_record_clears_fresh_places_marks_prompts_and_recounts_recomputed_outputs():
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 3, (PENALTY_PLACES, V)).astype(np.int32)
    in_prompt = rng.random((PENALTY_PLACES, V)) < 0.3
    # Row 0: a decode row of place 5 (position 9, past its count_from: counted when sampled).
    # Row 1: no place. Row 2: place 3, new (fresh), a resumed request's recomputation: prompt of
    # 4 tokens, then 3 outputs already generated (count_from 7), positions 0..6.
    # Row 3: place 7, a prompt chunk at positions 4..5 of a 10-token prompt.
    buf = _step(
        [
            [(9, 11)],
            [(0, 12), (1, 13)],
            [(0, 1), (1, 2), (2, 1), (3, 4), (4, 2), (5, 2), (6, 30)],
            [(4, 20), (5, 21)],
        ]
    )
    rows, flags = LAYOUT.view(buf, "penalty_rows"), LAYOUT.view(buf, "penalty_flags")
    prompt_len, count_from = (
        LAYOUT.view(buf, "penalty_prompt_len"),
        LAYOUT.view(buf, "penalty_count_from"),
    )
    rows[5], prompt_len[5], count_from[5] = 0, 3, 8
    rows[3], flags[3], prompt_len[3], count_from[3] = 2, PENALTY_FRESH, 4, 7
    rows[7], prompt_len[7], count_from[7] = 3, 10, 10
    c, p, _ = _record(buf, counts, in_prompt)

    expected_c, expected_p = counts.copy(), in_prompt.copy()
    expected_c[3], expected_p[3] = 0, False
    expected_p[3, [1, 2, 4]] = True  # its prompt
    expected_c[3, 2] += 2  # its recomputed outputs: 2, 2, 30
    expected_c[3, 30] += 1
    expected_p[7, [20, 21]] = True
    np.testing.assert_array_equal(c, expected_c)
    np.testing.assert_array_equal(p, expected_p)


def test_penalties_follow_vllms_formulas_on_the_places_rows_only():
    rng = np.random.default_rng(1)
    logits = rng.normal(0, 3, (S, V)).astype(np.float32)
    counts = np.zeros((PENALTY_PLACES, V), np.int32)
    in_prompt = np.zeros((PENALTY_PLACES, V), bool)
    counts[2, [3, 4, 5]] = [1, 2, 4]
    in_prompt[2, [4, 9, 10]] = True
    counts[8, 0] = 3
    buf = LAYOUT.new_step()
    rows = LAYOUT.view(buf, "penalty_rows")
    rows[2], rows[8] = 4, 1
    for name, values in (
        ("presence_penalty", {2: 0.5, 8: -1.0}),
        ("frequency_penalty", {2: 0.25, 8: 0.0}),
        ("repetition_penalty", {2: 1.7, 8: 1.0}),
    ):
        view = LAYOUT.view(buf, name)
        view[:] = 1.0 if name == "repetition_penalty" else 0.0
        for place, v in values.items():
            view[place] = v
    row = unpack_rows(LAYOUT, jnp.asarray(buf))
    out = np.asarray(apply_penalties(jnp.asarray(logits), counts, in_prompt, row))

    expected = logits.copy()
    for place, r, pres, freq, rep in ((2, 4, 0.5, 0.25, 1.7), (8, 1, -1.0, 0.0, 1.0)):
        x = expected[r]
        seen = in_prompt[place] | (counts[place] > 0)
        x = np.where(seen, np.where(x > 0, x / rep, x * rep), x)
        expected[r] = x - freq * counts[place] - pres * (counts[place] > 0)
    np.testing.assert_allclose(out, expected, rtol=1e-6)
    assert not np.array_equal(out[4], logits[4]) and not np.array_equal(out[1], logits[1])
    np.testing.assert_array_equal(out[[0, 2, 3, 5]], logits[[0, 2, 3, 5]])  # no place


def test_only_the_places_whose_row_sampled_count_their_token():
    counts = np.zeros((PENALTY_PLACES, V), np.int32)
    buf = LAYOUT.new_step()
    rows, flags = LAYOUT.view(buf, "penalty_rows"), LAYOUT.view(buf, "penalty_flags")
    rows[0], flags[0] = 2, PENALTY_SAMPLES
    rows[1], flags[1] = 3, 0  # a prefill chunk that ends before its prompt does: no sample
    rows[4], flags[4] = 0, PENALTY_SAMPLES | PENALTY_FRESH
    tokens = np.array([7, 8, 9, 10, 11, 12], np.int32)
    out = np.asarray(
        count_samples(
            jnp.asarray(counts), jnp.asarray(tokens), unpack_rows(LAYOUT, jnp.asarray(buf))
        )
    )
    expected = counts.copy()
    expected[0, 9] = expected[4, 7] = 1
    np.testing.assert_array_equal(out, expected)
