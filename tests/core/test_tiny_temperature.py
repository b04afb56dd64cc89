"""A temperature below 1e-5 samples greedily (vLLM's rule): the plan builder writes 0.0 for it,
since logits / T overflows float32 near T = 1e-38 and the overflowed tokens would tie."""

from __future__ import annotations

import numpy as np

from nori_jax.core.plan_builder import PlanBuilder
from nori_jax.core.sampling_modes import GREEDY, RANDOM, choose_program
from nori_jax.core.scheduler_output import Acquire


def test_a_temperature_below_1e_5_is_greedy_and_one_above_is_kept():
    builder = PlanBuilder(4, 2, 16, 8, [16], 320)
    temperatures = [1.2e-38, 9.99e-6, 1e-5, 0.7]
    builder.apply(
        [Acquire(slot, [slot + 1], t, 1.0, 0, seed=0) for slot, t in enumerate(temperatures)]
    )
    stored = builder.temperature[:4]
    np.testing.assert_array_equal(stored, np.float32([0.0, 0.0, 1e-5, 0.7]))
    top_p, top_k = np.ones(2, np.float32), np.zeros(2, np.int32)
    assert choose_program(stored[:2], top_p, top_k, 16)[0] == GREEDY
    assert choose_program(stored[2:], top_p, top_k, 16)[0] == RANDOM
