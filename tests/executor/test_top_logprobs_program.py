"""The top-logprobs program (executor/step_programs.py) on a hand-made step buffer, against numpy:
each listed row's TOP_LOGPROBS most likely tokens with their logprobs, best first, in list order,
from any bucket that holds the list (the same pairs from a larger one), never reading past it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from nori_jax.core.step_layout import TOP_LOGPROBS, StepLayout
from nori_jax.executor.step_programs import top_logprobs_from_logits

S, V = 40, 64
LAYOUT = StepLayout(max_num_seqs=S, max_pages_per_seq=4, max_num_batched_tokens=64)


def _pairs(count: int, logits: np.ndarray, listed: list[int]) -> tuple[np.ndarray, np.ndarray]:
    step = LAYOUT.new_step()
    LAYOUT.view(step, "top_rows")[: len(listed)] = listed
    out = jax.jit(top_logprobs_from_logits, static_argnums=(0, 1))(
        LAYOUT, count, jnp.asarray(logits), jnp.asarray(step)
    )
    pairs = np.asarray(out).reshape(2, count, TOP_LOGPROBS)
    return pairs[0], pairs[1].view(np.float32)


def test_listed_rows_get_their_best_tokens_in_list_order_from_any_bucket():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((S, V)).astype(np.float32) * 3
    listed = [2, 5, 17, 18, 30, 39]  # more than a bucket of 4, fewer than 16
    ref = logits - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    for count in (len(listed), 16, S):
        ids, values = _pairs(count, logits, listed)
        for p, row in enumerate(listed):
            want = np.argsort(-ref[row], kind="stable")[:TOP_LOGPROBS]
            assert ids[p].tolist() == want.tolist(), (count, row)
            np.testing.assert_allclose(values[p], ref[row, want], atol=1e-5)
    # a bucket smaller than the list computes its first entries only
    ids, _ = _pairs(4, logits, listed)
    assert ids.shape == (4, TOP_LOGPROBS)
    assert ids[3].tolist() == np.argsort(-ref[18], kind="stable")[:TOP_LOGPROBS].tolist()
