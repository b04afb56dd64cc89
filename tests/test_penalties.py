"""Presence, frequency and repetition penalties and min_tokens in the engine, against Hugging Face
transformers on the same checkpoint: its own generate() where it has the setting (repetition
penalty, min_new_tokens), its float32 logits with vLLM's formulas where it has not (presence,
frequency). One engine with a small KV pool, so a batch preempts."""

from __future__ import annotations

import numpy as np
import pytest
from engine_fixtures import small_llm

from nori_jax import LLM, SamplingParams

PROMPT = [11, 22, 33, 44, 55, 11, 22, 9, 9, 9]
PAGE = 16


@pytest.fixture(scope="module")
def llm(hf_checkpoints) -> LLM:
    # 15 usable pages of 16 tokens: a batch of the prompts below preempts.
    return small_llm(str(hf_checkpoints["llama"]), num_pages=16, max_model_len=128, kv_headroom=0.0)


@pytest.fixture(scope="module")
def hf_model(hf_checkpoints):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(hf_checkpoints["llama"], dtype=torch.float32)


def _hf_generate(model, prompt: list[int], max_new_tokens: int, **kwargs) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
            **kwargs,
        )
    return out[0, len(prompt) :].tolist()


def _reference_greedy(model, prompt, n, presence=0.0, frequency=0.0, repetition=1.0):
    """Greedy decoding on transformers' float32 logits penalized by vLLM's formulas (numpy), and
    each step's log-softmax of the penalized logits."""
    import torch

    seq, out, logprobs = list(prompt), [], []
    for _ in range(n):
        with torch.no_grad():
            x = model(torch.tensor([seq])).logits[0, -1].numpy().astype(np.float64)
        counts = np.bincount(out, minlength=len(x))
        seen = counts > 0
        seen[prompt] = True
        x = np.where(seen, np.where(x > 0, x / repetition, x * repetition), x)
        x = x - frequency * counts - presence * (counts > 0)
        tok = int(np.argmax(x))
        logprobs.append(x - np.log(np.exp(x - x.max()).sum()) - x.max())
        out.append(tok)
        seq.append(tok)
    return out, logprobs


def _greedy(n: int = 12, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kwargs)


@pytest.mark.parametrize("penalty", [1.8, 0.7])
def test_repetition_penalty_equals_transformers(llm, hf_model, penalty):
    ours = llm.generate([PROMPT], _greedy(repetition_penalty=penalty))[0].token_ids
    theirs = _hf_generate(
        hf_model, PROMPT, 12, repetition_penalty=penalty, min_new_tokens=12, eos_token_id=None
    )
    assert ours == theirs
    assert ours != llm.generate([PROMPT], _greedy())[0].token_ids  # the penalty changed them


def test_presence_and_frequency_penalties_against_the_formulas(llm, hf_model):
    cases = [
        dict(presence_penalty=1.5),
        dict(frequency_penalty=0.8),
        dict(presence_penalty=-0.5, frequency_penalty=0.6, repetition_penalty=1.3),
    ]
    outs = llm.generate([PROMPT] * 3, [_greedy(logprobs=3, **c) for c in cases])
    for case, out in zip(cases, outs, strict=True):
        tokens, rows = _reference_greedy(
            hf_model,
            PROMPT,
            12,
            presence=case.get("presence_penalty", 0.0),
            frequency=case.get("frequency_penalty", 0.0),
            repetition=case.get("repetition_penalty", 1.0),
        )
        assert out.token_ids == tokens, case
        # the sampled token's logprob and the top 3: of the penalized distribution
        sampled = [r[t] for r, t in zip(rows, tokens, strict=True)]
        np.testing.assert_allclose(out.logprobs, sampled, atol=1e-4)
        for top, r in zip(out.top_logprobs, rows, strict=True):
            assert [t for t, _ in top] == np.argsort(-r)[:3].tolist()
            np.testing.assert_allclose([v for _, v in top], np.sort(r)[::-1][:3], atol=1e-4)
    assert llm.engine.num_recompiles == 0


def test_min_tokens_equals_transformers_min_new_tokens(llm, hf_model):
    plain = llm.generate([PROMPT], _greedy())[0].token_ids
    eos = plain[2]  # a stop token greedy decoding reaches at its third token
    ours = llm.generate(
        [PROMPT],
        SamplingParams(max_tokens=12, temperature=0.0, min_tokens=6, stop_token_ids=[eos]),
    )[0]
    theirs = _hf_generate(hf_model, PROMPT, 12, min_new_tokens=6, eos_token_id=eos)
    assert ours.token_ids == theirs
    assert len(ours.token_ids) >= 6 and eos not in ours.token_ids[:6]
    # without min_tokens it stops at the third token
    stopped = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[eos])
    assert llm.generate([PROMPT], stopped)[0].token_ids == plain[:3]


def test_penalized_requests_in_a_preempting_batch_equal_each_alone(llm):
    """Each request's tokens are the same alone and in a batch that preempts (its counts rebuilt
    on resuming), beside neighbours without penalties, which the penalties leave untouched."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 300, int(n)).tolist() for n in (40, 9, 60, 25, 33, 50)]
    params = [
        _greedy(24, repetition_penalty=1.4),
        _greedy(24),
        SamplingParams(
            max_tokens=24, temperature=0.9, seed=5, ignore_eos=True, frequency_penalty=0.7
        ),
        SamplingParams(max_tokens=24, temperature=1.0, seed=6, ignore_eos=True),
        _greedy(24, presence_penalty=1.0, repetition_penalty=0.8),
        SamplingParams(
            max_tokens=24, temperature=0.8, top_k=20, seed=7, ignore_eos=True, presence_penalty=0.5
        ),
    ]
    before = llm.get_metrics()["nori:num_preemptions_total"]
    together = [o.token_ids for o in llm.generate(prompts, params)]
    assert llm.get_metrics()["nori:num_preemptions_total"] > before
    alone = [llm.generate([p], q)[0].token_ids for p, q in zip(prompts, params, strict=True)]
    assert together == alone
    assert llm.engine.num_recompiles == 0
    assert llm.engine.scheduler.allocator.num_used_pages == 0


def test_a_cached_prompt_still_counts_for_the_repetition_penalty(llm, hf_model):
    """The prompt's first two pages come from the prefix cache: their tokens pass through no
    step, and reach the penalty as marks in the request's first step."""
    rng = np.random.default_rng(9)
    prompt = rng.integers(3, 300, 40).tolist()  # 40 tokens: two full pages reach the cache
    llm.generate([prompt], _greedy(2))
    hits = llm.get_metrics()["nori:prefix_cache_hits_total"]
    ours = llm.generate([prompt], _greedy(repetition_penalty=1.8))[0].token_ids
    assert llm.get_metrics()["nori:prefix_cache_hits_total"] == hits + 2 * PAGE
    theirs = _hf_generate(
        hf_model, prompt, 12, repetition_penalty=1.8, min_new_tokens=12, eos_token_id=None
    )
    assert ours == theirs
