"""Prompt logprobs (`SamplingParams.prompt_logprobs`) against transformers' float32 logits of the
same checkpoint: every prompt token's logprob given those before it, and its position's most
likely tokens, through chunked prefill (positions take spare logit rows, a few per step), beside
requests that do not ask, and through preemption. One engine with a small step and KV pool."""

from __future__ import annotations

import numpy as np
import pytest
from engine_fixtures import small_llm
from model_harness import hf_logits

from nori_jax import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(hf_checkpoints) -> LLM:
    # 8 rows a step: a 60-token prompt's logprobs take several steps; 15 usable pages of 16.
    return small_llm(str(hf_checkpoints["llama"]), num_pages=16, max_model_len=128, kv_headroom=0.0)


def _reference(path, prompt: list[int]) -> np.ndarray:
    """float64 log-softmax of transformers' logits at every prompt position."""
    x = hf_logits(path, prompt).astype(np.float64)
    return (
        x - x.max(-1, keepdims=True) - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1))[:, None]
    )


def _check(path, prompt, out, k):
    ref = _reference(path, prompt)
    assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
    want = [ref[p, prompt[p + 1]] for p in range(len(prompt) - 1)]
    np.testing.assert_allclose(out.prompt_logprobs[1:], want, atol=2e-4)
    ranks = [1 + int((ref[p] > ref[p, prompt[p + 1]]).sum()) for p in range(len(prompt) - 1)]
    assert out.prompt_logprob_ranks == [None, *ranks]
    if not k:
        assert out.prompt_top_logprobs is None
        return
    assert out.prompt_top_logprobs[0] is None
    for p, top in enumerate(out.prompt_top_logprobs[1:]):
        assert len(top) == k
        ids = [t for t, _ in top]
        np.testing.assert_allclose([v for _, v in top], ref[p, ids], atol=2e-4)
        assert ref[p, ids[-1]] >= np.sort(ref[p])[-k] - 2e-4  # none better left out


def test_prompt_logprobs_against_transformers_beside_other_requests(llm, hf_checkpoints):
    path = hf_checkpoints["llama"]
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 300, n).tolist() for n in (60, 7, 33, 20, 1)]
    ks = [0, None, 5, 1, 3]
    greedy = dict(max_tokens=4, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, [SamplingParams(**greedy, prompt_logprobs=k) for k in ks])
    for prompt, k, out in zip(prompts, ks, outs, strict=True):
        if k is None:
            assert out.prompt_logprobs is None
        elif len(prompt) == 1:
            assert out.prompt_logprobs == [None] and out.prompt_top_logprobs == [None]
        else:
            _check(path, prompt, out, k)
    # asking changes no request's tokens
    plain = llm.generate(prompts, SamplingParams(**greedy))
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert llm.engine.num_recompiles == 0
    assert llm.engine.scheduler.allocator.num_used_pages == 0


def test_prompt_logprobs_through_preemption_and_a_cached_prompt(llm, hf_checkpoints):
    """Long-running requests fill the pool while two asking requests prefill, so those are
    preempted mid-prompt: each position's logprob is still computed once and comes back in
    order. A prompt already in the prefix cache is computed again for its logprobs."""
    path = hf_checkpoints["llama"]
    rng = np.random.default_rng(4)
    long_runs = [rng.integers(3, 300, 30).tolist() for _ in range(3)]
    asking = [rng.integers(3, 300, int(n)).tolist() for n in (50, 45)]
    params = [SamplingParams(max_tokens=90, temperature=0.0, ignore_eos=True)] * 3 + [
        SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    ] * 2
    outs = llm.generate(long_runs + asking, params)
    assert sum(o.metrics.num_preemptions for o in outs[3:]) > 0
    for prompt, out in zip(asking, outs[3:], strict=True):
        _check(path, prompt, out, 2)
    hits = llm.get_metrics()["nori:prefix_cache_hits_total"]
    again = llm.generate(
        [asking[0]], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=0)
    )[0]
    assert llm.get_metrics()["nori:prefix_cache_hits_total"] == hits
    _check(path, asking[0], again, 0)
