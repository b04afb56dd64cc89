"""The model against Hugging Face transformers on the same tiny random checkpoints (float32)."""

from __future__ import annotations

import numpy as np
import pytest
from model_harness import PagedSequence, hf_greedy, hf_logits, load

from nori_jax import LLM, SamplingParams

MODELS = ["llama", "qwen2", "mistral"]
PROMPTS = [
    [5, 17, 33, 101, 7, 250, 12, 99, 64, 3, 180, 44, 21],
    [9],
    list(range(40, 77)),
    [300, 2, 150, 151, 152, 8, 8, 8],
]
NEW_TOKENS = 32


@pytest.mark.parametrize("name", MODELS)
def test_logits_match_transformers(hf_checkpoints, name):
    path = hf_checkpoints[name]
    tokens = PROMPTS[0] + PROMPTS[2]
    ours = PagedSequence(load(path)).feed(tokens)
    ref = hf_logits(path, tokens)
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", MODELS)
def test_greedy_tokens_match_transformers_batched(hf_checkpoints, name):
    """Several prompts of different lengths generated together give transformers' greedy tokens."""
    path = hf_checkpoints[name]
    llm = LLM(
        str(path),
        dtype="float32",
        page_size=16,
        num_pages=48,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=128,
    )
    outs = llm.generate(
        PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    )
    expected = hf_greedy(path, PROMPTS, NEW_TOKENS)
    for out, want in zip(outs, expected, strict=True):
        assert out.token_ids == want
        assert out.finish_reason == "length"
    assert llm.engine.num_recompiles == 0
