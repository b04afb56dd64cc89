"""The sampler's filter thresholds by counting passes (executor/filter_search.py) equal the sort
form's: top-k, top-p, min-p and their mixes, ties, -inf entries, k past the vocabulary; the keys'
order and the search itself on hand-made cases; the sampler's tokens under either form."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nori_jax.core.sampling_modes import choose_program
from nori_jax.executor import filter_search
from nori_jax.executor.filter_search import float_to_key, key_to_float, smallest_true
from nori_jax.executor.sampler import filter_thresholds, sample

SEARCH_FORMS = ("search", "search_siblings")


def test_keys_follow_the_float_order():
    values = np.asarray([-np.inf, -3e38, -2.5, -1e-45, -0.0, 0.0, 1e-45, 1.0, 3e38, np.inf])
    keys = np.asarray(float_to_key(jnp.asarray(values, jnp.float32)))
    assert keys.dtype == np.uint32
    assert (np.diff(keys.astype(np.int64)) > 0).all()  # -0.0 just below +0.0
    assert keys[[0, 4, 5, 7]].tolist() == [0x007FFFFF, 0x7FFFFFFF, 0x80000000, 0xBF800000]
    back = np.asarray(key_to_float(jnp.asarray(keys)))
    np.testing.assert_array_equal(back.view(np.uint32), values.astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_the_search_finds_the_smallest_value_where_the_test_turns_true(bits):
    # One row per answer: inside the range, at each end, below zero, zero (which a search under
    # flushed denormals reaches from the most negative denormal), the smallest normal, and past
    # the range's end (a test false everywhere: the end).
    answers = np.asarray([0.75, -3.0, -np.inf, 7.0, 0.0, -1.2e-38, np.inf], np.float32)
    lo = float_to_key(jnp.full(7, -np.inf, jnp.float32))
    hi = float_to_key(jnp.full(7, 7.0, jnp.float32))
    found = jax.jit(smallest_true, static_argnums=(0, 3))(
        lambda v: v >= jnp.asarray(answers)[:, None], lo, hi, bits
    )
    np.testing.assert_array_equal(np.asarray(found), np.minimum(answers, 7.0))


def test_a_number_of_bits_that_does_not_divide_32_is_refused():
    lo = jnp.zeros(1, jnp.uint32)
    with pytest.raises(ValueError, match="bits=3 must divide 32"):
        smallest_true(lambda v: v > 0, lo, lo, 3)


def _rows(seed: int, kind: str, rows: int = 12, vocab: int = 700):
    """Logits and per-row settings: every row a different mix of top-k, top-p and min-p."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, vocab)) * rng.uniform(0.5, 4.0)).astype(np.float32)
    if kind == "ties":  # few distinct values: ties at every threshold
        x = np.round(x).astype(np.float32)
    if kind == "neg_inf":  # a banned tail, as logit_bias or a vocabulary pad leaves
        x[:, 9:] = -np.inf
    top_k = rng.integers(1, 60, rows).astype(np.int32)
    top_k[::3] = 0  # off
    top_k[1] = vocab  # the whole vocabulary, and past it
    top_k[2] = np.iinfo(np.int32).max
    top_p = rng.uniform(0.05, 1.0, rows).astype(np.float32)
    top_p[::4] = 1.0
    top_p[5] = 1e-7  # the most likely token alone
    top_p[6] = 1e-50  # valid, and 0.0 in float32: the most likely token alone too
    min_p = np.where(rng.random(rows) < 0.4, rng.uniform(0.01, 0.6, rows), 0.0)
    return x, top_k, top_p, min_p.astype(np.float32)


@functools.cache
def _thresholds(form: str):
    return jax.jit(functools.partial(filter_thresholds, form=form))


@pytest.mark.parametrize("form", SEARCH_FORMS)
@pytest.mark.parametrize("kind", ["normal", "ties", "neg_inf"])
@pytest.mark.parametrize("seed", [0, 1])
def test_the_search_gives_the_sort_threshold(form, kind, seed):
    x, top_k, top_p, min_p = _rows(seed, kind)
    want = np.asarray(_thresholds("sort")(x, top_k, top_p, min_p))
    got = np.asarray(_thresholds(form)(x, top_k, top_p, min_p))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("form", ["sort", *SEARCH_FORMS])
def test_top_p_renormalizes_over_exactly_k_tokens_when_top_k_cuts_a_tie(form):
    # top_k = 2 keeps the 2.0 and one of the three 1.0s by rank: probabilities 0.731 and 0.269
    # over exactly two tokens, so top_p = 0.75 keeps the second, and with it every tied 1.0.
    # (Counting all three 1.0s, or none, in the normalizer would keep the 2.0 alone.)
    x = jnp.asarray([[2.0, 1.0, 1.0, 1.0, 0.0, -1.0]], jnp.float32)
    got = _thresholds(form)(x, jnp.asarray([2]), jnp.asarray([0.75]), jnp.zeros(1))
    assert float(got[0]) == 1.0
    got = _thresholds(form)(x, jnp.asarray([2]), jnp.asarray([0.7]), jnp.zeros(1))
    assert float(got[0]) == 2.0


def test_the_sampler_draws_the_same_tokens_under_either_form():
    rows, vocab = 64, 300
    rng = np.random.default_rng(3)
    logits = jnp.asarray(rng.standard_normal((rows, vocab)) * 2, jnp.float32)
    temperature = np.where(rng.random(rows) < 0.2, 0.0, rng.uniform(0.3, 1.5, rows))
    top_p = np.where(rng.random(rows) < 0.6, rng.uniform(0.1, 0.99, rows), 1.0)
    top_k = np.where(rng.random(rows) < 0.5, rng.integers(1, 50, rows), 0).astype(np.int32)
    min_p = np.where(rng.random(rows) < 0.3, 0.1, 0.0)
    program, filtered = choose_program(temperature, top_p, top_k, rows, min_p)
    assert program.kind == "filter"
    filter_rows = np.full(rows, rows, np.int32)
    filter_rows[: len(filtered)] = filtered
    args = [
        logits,
        *(jnp.asarray(a, jnp.float32) for a in (temperature, top_p)),
        jnp.asarray(top_k),
        jnp.asarray(min_p, jnp.float32),
        jnp.arange(rows, dtype=jnp.int32),  # seeds
        jnp.zeros(rows, jnp.int32),  # output index
        jnp.asarray(filter_rows),
    ]
    tokens = {}
    for form in ("sort", "search"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("NORI_JAX_FILTER", form)
            # the form is read while tracing: a fresh jit per form
            out, _ = jax.jit(functools.partial(sample, program=program))(*args)
        tokens[form] = np.asarray(out)
    np.testing.assert_array_equal(tokens["search"], tokens["sort"])


@pytest.mark.parametrize("form", SEARCH_FORMS)
def test_the_search_program_has_no_control_flow(form):
    x, top_k, top_p, min_p = _rows(0, "normal", rows=8, vocab=64)
    hlo = _thresholds(form).lower(x, top_k, top_p, min_p).compile().as_text()
    assert "sort(" not in hlo
    assert not [line for line in hlo.splitlines() if " while(" in line or " conditional(" in line]


def test_the_environment_picks_the_form(monkeypatch):
    monkeypatch.delenv("NORI_JAX_FILTER", raising=False)
    assert filter_search.default_form() == "auto"
    monkeypatch.setenv("NORI_JAX_FILTER", "search_siblings")
    assert filter_search.default_form() == "search_siblings"
    monkeypatch.setenv("NORI_JAX_FILTER", "radix")
    with pytest.raises(ValueError, match="NORI_JAX_FILTER='radix'"):
        filter_search.default_form()
    with pytest.raises(ValueError, match="filter form 'radix'"):
        filter_thresholds(
            jnp.zeros((1, 4)), jnp.zeros(1, jnp.int32), jnp.ones(1), jnp.zeros(1), "radix"
        )


@pytest.mark.parametrize(
    "rows, vocab, platform, form",
    [
        (16, 49_152, "gpu", "sort"),
        (64, 49_152, "gpu", "sort"),
        (16, 128_256, "gpu", "search"),
        (64, 128_256, "gpu", "search"),
        (256, 49_152, "gpu", "search_siblings"),
        (1024, 128_256, "gpu", "search_siblings"),
        (1024, 128_256, "cpu", "sort"),
        (16, 128_256, "cpu", "sort"),
    ],
)
def test_auto_takes_the_form_measured_fastest_for_the_bucket(rows, vocab, platform, form):
    assert filter_search.auto_form(rows, vocab, platform) == form


@pytest.mark.parametrize(
    "rows, vocab, sorts", [(16, 300, True), (16, 70_000, False), (256, 300, False)]
)
def test_the_sampler_runs_the_form_auto_picks_on_a_gpu(monkeypatch, rows, vocab, sorts):
    monkeypatch.delenv("NORI_JAX_FILTER", raising=False)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    x = jnp.zeros((rows, vocab), jnp.float32)
    settings = (jnp.zeros(rows, jnp.int32), jnp.full(rows, 0.9), jnp.zeros(rows))
    hlo = jax.jit(filter_thresholds).lower(x, *settings).as_text()
    assert ("stablehlo.sort" in hlo) == sorts
