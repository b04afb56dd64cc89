"""The sampler against the exact distributions, per mode, and per-request determinism.

Distributions: many seeded draws of one row's settings (one seed per row of a batch) against the
probabilities computed directly in numpy, with a chi-square test; tokens outside the top-k /
top-p set must never appear. A small cap (6 of 12 tokens) sends some settings through the capped
`lax.top_k` path and the others through the FULL program's sort.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from nori_jax.core.sampling_modes import SamplerMode, choose_mode, normalize_top_k
from nori_jax.executor.sampler import sample

VOCAB, CAP, DRAWS = 12, 6, 6000
LOGITS = np.asarray([2.0, 1.6, 1.5, 1.1, 0.9, 0.4, 0.3, 0.0, -0.2, -0.5, -1.0, -2.0], np.float32)


def expected_probs(temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """The target distribution, computed directly: softmax(logits / T), top-k, then top-p."""
    z = LOGITS.astype(np.float64) / temperature
    order = np.argsort(-z, kind="stable")
    keep = np.zeros(VOCAB, bool)
    k = top_k if top_k > 0 else VOCAB
    kept = order[:k]
    p = np.exp(z[kept] - z[kept].max())
    p /= p.sum()
    before = np.cumsum(p) - p
    keep[kept[before < top_p]] = True
    out = np.where(keep, np.exp(z - z.max()), 0.0)
    return out / out.sum()


@functools.lru_cache(maxsize=None)
def _sampler(mode: SamplerMode):
    return jax.jit(functools.partial(sample, mode=mode, top_k_cap=CAP))


def draw(rows: dict[str, np.ndarray], mode: SamplerMode | None = None) -> np.ndarray:
    n = len(rows["temperature"])
    top_k = np.asarray([normalize_top_k(int(k), VOCAB) for k in rows["top_k"]], np.int32)
    if mode is None:
        mode = choose_mode(rows["temperature"], rows["top_p"], top_k, CAP, VOCAB)
    tokens, _ = _sampler(mode)(
        jnp.asarray(np.broadcast_to(LOGITS, (n, VOCAB))),
        jnp.asarray(rows["temperature"], jnp.float32),
        jnp.asarray(rows["top_p"], jnp.float32),
        jnp.asarray(top_k),
        jnp.asarray(rows["seeds"], jnp.int32),
        jnp.asarray(rows["sample_index"], jnp.int32),
    )
    return np.asarray(tokens)


def rows_of(n: int, temperature=1.0, top_k=0, top_p=1.0, seed0=0) -> dict[str, np.ndarray]:
    return {
        "temperature": np.full(n, temperature, np.float32),
        "top_k": np.full(n, top_k, np.int32),
        "top_p": np.full(n, top_p, np.float32),
        "seeds": np.arange(seed0, seed0 + n, dtype=np.int32),
        "sample_index": np.zeros(n, np.int32),
    }


@pytest.mark.parametrize(
    "temperature,top_k,top_p,mode",
    [
        (1.0, 0, 1.0, SamplerMode.SAMPLE),  # no filter
        (0.7, 4, 1.0, SamplerMode.SAMPLE),  # top-k inside the cap
        (1.3, 5, 0.8, SamplerMode.SAMPLE),  # both, inside the cap
        (1.0, 0, 0.7, SamplerMode.FULL),  # top-p alone: the full-vocabulary filter
        (0.8, 9, 1.0, SamplerMode.FULL),  # top-k past the cap
        (1.0, 8, 0.9, SamplerMode.FULL),  # both, past the cap
    ],
)
def test_distribution_matches_the_exact_computation(temperature, top_k, top_p, mode):
    rows = rows_of(DRAWS, temperature, top_k, top_p)
    assert choose_mode(rows["temperature"], rows["top_p"], rows["top_k"], CAP, VOCAB) == mode
    counts = np.bincount(draw(rows), minlength=VOCAB)
    p = expected_probs(temperature, top_k, top_p)
    assert counts[p == 0].sum() == 0, f"tokens outside the kept set were drawn: {counts}"
    kept = p > 0
    result = stats.chisquare(counts[kept], p[kept] * DRAWS)
    assert result.pvalue > 1e-4, (counts, np.round(p * DRAWS, 1), result)


def test_a_row_draws_the_same_token_alone_and_in_any_batch_and_mode():
    """Tokens depend on a request's own seed and settings, not on its neighbours or the mode
    their settings force."""
    mine = rows_of(64, temperature=0.9, top_k=4, top_p=0.95, seed0=100)
    alone = draw(mine)
    assert choose_mode(mine["temperature"], mine["top_p"], mine["top_k"], CAP, VOCAB) == (
        SamplerMode.SAMPLE
    )
    neighbours = rows_of(64, temperature=1.0, top_k=0, top_p=0.5, seed0=7)  # forces FULL
    mixed = {k: np.concatenate([neighbours[k], mine[k]]) for k in mine}
    assert draw(mixed)[64:].tolist() == alone.tolist()
    # A greedy row is the argmax in every mode.
    greedy = rows_of(4, temperature=0.0, top_k=3, top_p=0.5)
    for mode in SamplerMode:
        assert (draw(greedy, mode) == int(np.argmax(LOGITS))).all()


def test_seed_and_output_index_select_the_stream():
    rows = rows_of(256, temperature=1.0)
    again = draw(rows)
    assert draw(rows).tolist() == again.tolist()  # same seeds, same tokens
    rows["sample_index"][:] = 1
    assert draw(rows).tolist() != again.tolist()  # the next output index draws afresh


def test_choose_mode_picks_the_cheapest_exact_program():
    z = np.zeros(3, np.float32)
    one = np.ones(3, np.float32)
    assert choose_mode(z, one, np.zeros(3, np.int32), CAP, VOCAB) == SamplerMode.GREEDY
    t = np.asarray([0.0, 1.0, 0.0], np.float32)
    assert choose_mode(t, one, np.asarray([0, 4, 0]), CAP, VOCAB) == SamplerMode.SAMPLE
    assert choose_mode(t, one, np.asarray([0, 7, 0]), CAP, VOCAB) == SamplerMode.FULL
    assert choose_mode(t, one * 0.9, np.asarray([0, 0, 0]), CAP, VOCAB) == SamplerMode.FULL
    assert choose_mode(t, one * 0.9, np.asarray([0, 0, 0]), VOCAB, VOCAB) == SamplerMode.SAMPLE
    # A greedy row's wide filter does not matter.
    assert choose_mode(t, np.asarray([0.5, 1.0, 1.0]), np.asarray([0, 3, 0]), CAP, VOCAB) == (
        SamplerMode.SAMPLE
    )
    assert normalize_top_k(12, VOCAB) == 0 and normalize_top_k(2**40, VOCAB) == 0
