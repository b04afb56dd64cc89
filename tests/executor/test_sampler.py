"""The sampler against the exact distributions, per program, and per-request determinism.

Distributions: many seeded draws of one row's settings (one seed per row of a batch) against the
probabilities computed directly in numpy, with a chi-square test; tokens outside the min-p /
top-k / top-p set must never appear.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from nori_jax.core.sampling_modes import (
    GREEDY,
    RANDOM,
    SamplerProgram,
    choose_program,
    normalize_top_k,
    sampler_programs,
)
from nori_jax.executor.sampler import add_logit_bias, sample

VOCAB, DRAWS = 12, 6000
LOGITS = np.asarray([2.0, 1.6, 1.5, 1.1, 0.9, 0.4, 0.3, 0.0, -0.2, -0.5, -1.0, -2.0], np.float32)


def expected_probs(temperature: float, top_k: int, top_p: float, min_p: float = 0.0) -> np.ndarray:
    """The target distribution, computed directly: softmax(logits / T), then min-p (p >= min_p *
    p_max), top-k, and top-p on what is left, renormalized."""
    z = LOGITS.astype(np.float64) / temperature
    probs = np.exp(z - z.max())  # / sum: p / p_max is all min-p needs
    order = np.argsort(-z, kind="stable")
    order = order[probs[order] >= min_p]
    keep = np.zeros(VOCAB, bool)
    k = top_k if top_k > 0 else VOCAB
    kept = order[:k]
    p = np.exp(z[kept] - z[kept].max())
    p /= p.sum()
    before = np.cumsum(p) - p
    keep[kept[before < top_p]] = True
    out = np.where(keep, np.exp(z - z.max()), 0.0)
    return out / out.sum()


@functools.cache
def _sampler(program: SamplerProgram, filter_form: str = "sort"):
    jitted = jax.jit(functools.partial(sample, program=program))

    def call(*args):
        with pytest.MonkeyPatch.context() as mp:  # the form is read while tracing
            mp.setenv("NORI_JAX_FILTER", filter_form)
            return jitted(*args)

    return call


def draw(
    rows: dict[str, np.ndarray], program: SamplerProgram | None = None, filter_form: str = "sort"
) -> np.ndarray:
    n = len(rows["temperature"])
    top_k = np.asarray([normalize_top_k(int(k), VOCAB) for k in rows["top_k"]], np.int32)
    min_p = rows.get("min_p", np.zeros(n, np.float32))
    chosen, filtered = choose_program(rows["temperature"], rows["top_p"], top_k, n, min_p)
    filter_rows = np.full(n, n, np.int32)
    filter_rows[: len(filtered)] = filtered
    tokens, _ = _sampler(program or chosen, filter_form)(
        jnp.asarray(np.broadcast_to(LOGITS, (n, VOCAB))),
        jnp.asarray(rows["temperature"], jnp.float32),
        jnp.asarray(rows["top_p"], jnp.float32),
        jnp.asarray(top_k),
        jnp.asarray(min_p, jnp.float32),
        jnp.asarray(rows["seeds"], jnp.int32),
        jnp.asarray(rows["sample_index"], jnp.int32),
        jnp.asarray(filter_rows),
    )
    return np.asarray(tokens)


def rows_of(
    n: int, temperature=1.0, top_k=0, top_p=1.0, seed0=0, min_p=0.0
) -> dict[str, np.ndarray]:
    return {
        "temperature": np.full(n, temperature, np.float32),
        "top_k": np.full(n, top_k, np.int32),
        "top_p": np.full(n, top_p, np.float32),
        "min_p": np.full(n, min_p, np.float32),
        "seeds": np.arange(seed0, seed0 + n, dtype=np.int32),
        "sample_index": np.zeros(n, np.int32),
    }


@pytest.mark.parametrize(
    "temperature,top_k,top_p,min_p",
    [
        (1.0, 0, 1.0, 0.0),  # no filter
        (0.7, 4, 1.0, 0.0),  # top-k
        (1.0, 0, 0.7, 0.0),  # top-p
        (1.3, 5, 0.8, 0.0),  # both
        (0.8, 9, 0.999, 0.0),  # top-p that keeps all of a top-k set
        (1.0, 0, 1.0, 0.3),  # min-p alone: p >= 0.3 p_max keeps 5 of 12 tokens at T 1
        (2.0, 0, 1.0, 0.3),  # min-p after temperature: 9 tokens at T 2
        (1.5, 0, 0.6, 0.2),  # min-p, then top-p over what it keeps
        (1.0, 2, 1.0, 0.5),  # a top-k narrower than min-p's set
    ],
)
@pytest.mark.parametrize("filter_form", ["sort", "search"])
def test_distribution_matches_the_exact_computation(temperature, top_k, top_p, min_p, filter_form):
    rows = rows_of(DRAWS, temperature, top_k, top_p, min_p=min_p)
    program, _ = choose_program(
        rows["temperature"], rows["top_p"], rows["top_k"], DRAWS, rows["min_p"]
    )
    assert program.kind == ("random" if top_k == 0 and top_p == 1.0 and min_p == 0 else "filter")
    counts = np.bincount(draw(rows, filter_form=filter_form), minlength=VOCAB)
    p = expected_probs(temperature, top_k, top_p, min_p)
    assert counts[p == 0].sum() == 0, f"tokens outside the kept set were drawn: {counts}"
    kept = p > 0
    result = stats.chisquare(counts[kept], p[kept] * DRAWS)
    assert result.pvalue > 1e-4, (counts, np.round(p * DRAWS, 1), result)


@pytest.mark.parametrize("filter_form", ["sort", "search"])
def test_a_row_draws_the_same_token_alone_and_in_any_batch_and_program(filter_form):
    """Tokens depend on a request's own seed and settings, not on its neighbours or the program
    (and filter bucket) their settings choose."""
    pick = functools.partial(draw, filter_form=filter_form)
    mine = rows_of(16, temperature=0.9, top_k=4, top_p=0.95, seed0=100)
    plain = rows_of(16, temperature=1.1, seed0=300)
    alone, plain_alone = pick(mine), pick(plain)
    neighbours = rows_of(40, temperature=1.0, top_k=0, top_p=0.5, seed0=7)
    with_min_p = rows_of(8, temperature=1.2, min_p=0.2, seed0=500)
    neighbours = {k: np.concatenate([neighbours[k], with_min_p[k]]) for k in neighbours}
    greedy = rows_of(8, temperature=0.0, top_k=3, top_p=0.5)
    mixed = {k: np.concatenate([neighbours[k], mine[k], greedy[k], plain[k]]) for k in mine}
    got = pick(mixed)  # 64 filtering rows: a bigger bucket than `mine` alone took
    assert got[48:64].tolist() == alone.tolist()
    assert got[40:48].tolist() == pick(with_min_p).tolist()
    assert got[72:].tolist() == plain_alone.tolist()
    assert (got[64:72] == int(np.argmax(LOGITS))).all()
    # A greedy row is the argmax in every program.
    for program in sampler_programs(8):
        assert (pick(greedy, program) == int(np.argmax(LOGITS))).all()


def test_seed_and_output_index_select_the_stream():
    rows = rows_of(256, temperature=1.0)
    again = draw(rows)
    assert draw(rows).tolist() == again.tolist()  # same seeds, same tokens
    rows["sample_index"][:] = 1
    assert draw(rows).tolist() != again.tolist()  # the next output index draws afresh


def test_choose_program_picks_the_cheapest_exact_program():
    z, one = np.zeros(3, np.float32), np.ones(3, np.float32)
    none = np.zeros(3, np.int32)
    assert choose_program(z, one * 0.5, none + 3, 64)[0] == GREEDY  # greedy rows never filter
    t = np.asarray([0.0, 1.0, 0.0], np.float32)
    assert choose_program(t, one, none, 64)[0] == RANDOM
    program, rows = choose_program(t, one, np.asarray([0, 4, 0]), 64)
    assert program == SamplerProgram("filter", 16) and rows.tolist() == [1]
    t = np.ones(40, np.float32)
    program, rows = choose_program(t, np.full(40, 0.9, np.float32), np.zeros(40, np.int32), 256)
    assert program == SamplerProgram("filter", 64) and len(rows) == 40
    assert [p.name for p in sampler_programs(1024)] == [
        "greedy",
        "random",
        "filter-16",
        "filter-64",
        "filter-256",
        "filter-1024",
    ]
    assert normalize_top_k(12, VOCAB) == 0 and normalize_top_k(2**40, VOCAB) == 0


@pytest.mark.parametrize("rows", [1, 16, 17, 32, 64, 65, 1024])
def test_a_step_of_few_rows_needs_only_the_programs_listed_for_them(rows):
    """sampler_programs(S, R) holds whatever choose_program picks for a step of R rows (the
    runner compiles the random and filtering samplers per R = min(S, bucket))."""
    listed = sampler_programs(1024, rows)
    for filtering in range(rows + 1):
        t = np.ones(rows, np.float32)
        top_k = np.where(np.arange(rows) < filtering, 5, 0).astype(np.int32)
        assert choose_program(t, np.ones(rows, np.float32), top_k, 1024)[0] in listed
    assert len(listed) == len(set(listed))


def _bias(n: int, entries: list[tuple[int, int, float]], capacity: int = 16):
    """The step's logit_bias fields: (row, token, bias) entries, the rest adding 0.0."""
    rows, ids, values = (np.zeros(capacity, t) for t in (np.int32, np.int32, np.float32))
    for i, (r, t, b) in enumerate(entries):
        rows[i], ids[i], values[i] = r, t, b
    return jnp.asarray(rows), jnp.asarray(ids), jnp.asarray(values)


def _draw_biased(rows, bias, program: SamplerProgram | None = None):
    n = len(rows["temperature"])
    top_k = np.asarray(rows["top_k"], np.int32)
    chosen, filtered = choose_program(rows["temperature"], rows["top_p"], top_k, n, rows["min_p"])
    filter_rows = np.full(n, n, np.int32)
    filter_rows[: len(filtered)] = filtered
    logits = jax.jit(add_logit_bias)(jnp.asarray(np.broadcast_to(LOGITS, (n, VOCAB))), *bias)
    tokens, logprobs = _sampler(program or chosen)(
        logits,
        jnp.asarray(rows["temperature"]),
        jnp.asarray(rows["top_p"]),
        jnp.asarray(top_k),
        jnp.asarray(rows["min_p"]),
        jnp.asarray(rows["seeds"], jnp.int32),
        jnp.asarray(rows["sample_index"], jnp.int32),
        jnp.asarray(filter_rows),
    )
    return np.asarray(tokens), np.asarray(logprobs), np.asarray(logits)


def test_logit_bias_moves_greedy_and_sampled_rows_and_their_logprobs():
    rows = rows_of(4, temperature=0.0)
    rows["temperature"][2:] = 1.0
    rows["top_k"][3] = 3  # a filtering row: the bias applies before its top-k
    bias = _bias(4, [(0, 0, -100.0), (1, 7, 100.0), (2, 11, 100.0), (3, 10, 50.0)])
    tokens, logprobs, logits = _draw_biased(rows, bias)
    # row 0: the argmax banned -> the runner-up; 1: a +100 token wins greedy; 2 and 3 sampled
    assert tokens.tolist() == [1, 7, 11, 10]
    biased = np.tile(LOGITS.astype(np.float64), (4, 1))
    for r, t, b in [(0, 0, -100.0), (1, 7, 100.0), (2, 11, 100.0), (3, 10, 50.0)]:
        biased[r, t] += b
    np.testing.assert_allclose(logits, biased, rtol=1e-6)  # the entries, and nothing else
    log_z = np.log(np.exp(biased - biased.max(1, keepdims=True)).sum(1)) + biased.max(1)
    expected = biased[np.arange(4), tokens] - log_z  # under the distribution sampled from
    np.testing.assert_allclose(logprobs, expected, rtol=1e-5, atol=1e-6)
    plain, _, _ = _draw_biased(rows, _bias(4, []))
    assert plain.tolist()[:2] == [0, 0]  # without entries (all adding 0.0) nothing moves


def test_logit_bias_distribution_matches_the_exact_computation():
    """A moderate bias reshapes the distribution: softmax(logits + bias), then top-p on it."""
    bias_of = {3: 1.5, 0: -1.0, 9: 2.0}
    rows = rows_of(DRAWS, temperature=1.0, top_p=0.9)
    entries = [(r, t, b) for r in range(DRAWS) for t, b in bias_of.items()]
    tokens, _, _ = _draw_biased(rows, _bias(DRAWS, entries, capacity=len(entries)))
    z = LOGITS.astype(np.float64).copy()
    for t, b in bias_of.items():
        z[t] += b
    order = np.argsort(-z, kind="stable")
    p = np.exp(z[order] - z.max())
    p /= p.sum()
    keep = np.zeros(VOCAB, bool)
    keep[order[(np.cumsum(p) - p) < 0.9]] = True
    expected = np.where(keep, np.exp(z - z.max()), 0.0)
    expected /= expected.sum()
    counts = np.bincount(tokens, minlength=VOCAB)
    assert counts[expected == 0].sum() == 0
    kept = expected > 0
    result = stats.chisquare(counts[kept], expected[kept] * DRAWS)
    assert result.pvalue > 1e-4, (counts, np.round(expected * DRAWS, 1), result)
