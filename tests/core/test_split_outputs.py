"""An engine core shared by several API servers (engine_core_process.split_outputs): each gets the
rows of its own requests and every step's finishes, first tokens and stats."""

from __future__ import annotations

import numpy as np

from nori_jax.core.outputs import (
    EngineCoreOutputs,
    FinishedRequest,
    FirstToken,
    RequestMetrics,
    StepStats,
)
from nori_jax.engine_core_process import split_outputs


def test_rows_go_to_their_owner_and_the_rest_to_everyone():
    ids = ["a", "b", "c", "d"]
    tokens = np.array([10, 11, 12, 13], np.int32)
    finished = [FinishedRequest("b", "length", 3, 5, RequestMetrics(0, 0, 0, 0, 0, 0, 0))]
    first = [FirstToken("d", 0.1)]
    stats = StepStats(3, 0, 0.5, 4, 0, 0, 0, 0, 0.0, 0.01, 1)
    logprobs = np.array([-1.0, -2.0, -0.5, -0.25], np.float32)  # a column: one a row
    out = EngineCoreOutputs(ids, tokens.tobytes(), logprobs.tobytes(), finished, first, stats)
    owner = {"a": 1, "b": 0, "c": 1}  # "d": no known owner, so API server 0's
    zero, one, two = split_outputs(out, owner, 3)
    assert (zero.request_ids, zero.token_ids.tolist()) == (["b", "d"], [11, 13])
    assert zero.logprobs.tolist() == [-2.0, -0.25]
    assert (one.request_ids, one.token_ids.tolist()) == (["a", "c"], [10, 12])
    assert one.logprobs.tolist() == [-1.0, -0.5]
    assert (two.request_ids, two.token_ids.tolist(), two.logprobs.tolist()) == ([], [], [])
    without = EngineCoreOutputs(ids, tokens.tobytes(), b"", finished, first, stats)
    assert all(part.logprob_bytes == b"" for part in split_outputs(without, owner, 3))
    for part in (zero, one, two):
        assert part.finished == finished and part.first_tokens == first and part.stats == stats


def test_prompt_logprobs_go_to_their_owner_with_or_without_a_token_row():
    """A prompt's logprobs may complete in a step where its request gains no token (its prompt's
    last chunk still to come): they go to the request's API server all the same."""
    out = EngineCoreOutputs(["a"], np.array([7], np.int32).tobytes(), b"", [], [])
    out.prompt_logprobs = {"a": ([-1.0], None), "e": ([-2.0, -3.0], [[(4, -0.5)], [(5, -0.7)]])}
    zero, one = split_outputs(out, {"a": 0, "e": 1}, 2)
    assert zero.prompt_logprobs == {"a": ([-1.0], None)}
    assert one.request_ids == [] and one.prompt_logprobs == {"e": out.prompt_logprobs["e"]}
