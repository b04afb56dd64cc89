"""Scheduling never changes results: prefix caching, chunk budgets and preemption keep greedy
outputs identical to a plain run (issue: chunked prefill, prefix caching, preemption)."""

from __future__ import annotations

import numpy as np
import pytest
from engine_fixtures import small_llm

from nori_jax import SamplingParams

PAGE = 32
SYSTEM = [(i * 13 + 5) % 300 + 3 for i in range(2 * PAGE + 7)]  # a shared system prompt
rng = np.random.default_rng(11)
PROMPTS = [SYSTEM + rng.integers(3, 300, int(n)).tolist() for n in (1, 9, 40, 75, 3, 120)]
PROMPTS += [rng.integers(3, 300, int(n)).tolist() for n in (2, 50, 90)]
PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
BASE = dict(page_size=PAGE, num_pages=96, max_model_len=512, max_num_seqs=16)


@pytest.fixture(scope="module")
def reference_tokens(hf_checkpoints):
    llm = small_llm(
        str(hf_checkpoints["llama"]),
        **BASE,
        max_num_batched_tokens=256,
        enable_prefix_caching=False,
    )
    return [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]


@pytest.mark.parametrize(
    "overrides",
    [
        dict(max_num_batched_tokens=256, enable_prefix_caching=True),
        dict(max_num_batched_tokens=16, enable_prefix_caching=True),
        dict(max_num_batched_tokens=64, enable_prefix_caching=False),
        dict(max_num_batched_tokens=PAGE, enable_prefix_caching=True),
        dict(max_num_batched_tokens=64, enable_prefix_caching=True, async_scheduling=False),
    ],
    ids=["prefix-cache", "budget-16", "budget-64", "budget-one-page", "synchronous"],
)
def test_greedy_outputs_identical(hf_checkpoints, reference_tokens, overrides):
    kwargs = {**BASE, "max_num_seqs": min(16, overrides["max_num_batched_tokens"]), **overrides}
    llm = small_llm(str(hf_checkpoints["llama"]), **kwargs)
    outs = llm.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in outs] == reference_tokens
    first_hits = llm.get_metrics()["nori:prefix_cache_hits_total"]
    # Again: now every prompt finds at least the system prompt's two full pages cached.
    again = llm.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in again] == reference_tokens
    hits = llm.get_metrics()["nori:prefix_cache_hits_total"] - first_hits
    if overrides["enable_prefix_caching"]:
        assert hits >= 2 * PAGE * 6
        assert sum(o.metrics.num_cached_tokens for o in again) == hits
    else:
        assert hits == first_hits == 0
    assert llm.engine.scheduler.allocator.num_used_pages == 0


def test_preemption_under_a_tiny_kv_pool_loses_nothing(hf_checkpoints, reference_tokens):
    # 8 usable pages of 32 tokens: far less than the 9 requests need together (~40 pages).
    llm = small_llm(
        str(hf_checkpoints["llama"]),
        **{**BASE, "num_pages": 9, "max_model_len": 256},
        max_num_batched_tokens=128,
        kv_headroom=0.0,
    )
    outs = llm.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in outs] == reference_tokens
    assert llm.get_metrics()["nori:num_preemptions_total"] > 0
    assert (
        sum(o.metrics.num_preemptions for o in outs)
        == llm.get_metrics()["nori:num_preemptions_total"]
    )
    assert llm.engine.scheduler.allocator.num_used_pages == 0
