"""The engine with attention_backend="pallas" (Mosaic GPU kernel, interpret mode on CPU) against
transformers. Interpret mode costs about a second per layer and step, so the engine runs one
token bucket (16) and few steps: three prompts (13, 1 and 20 tokens) prefilled in 16-token
chunks, then 5 greedy tokens each (the first prompt's last one attends across its page
boundary)."""

from __future__ import annotations

import numpy as np
import pytest
from model_harness import PagedSequence, hf_greedy, hf_logits, load

from nori_jax import LLM, SamplingParams

PROMPTS = [[5, 17, 33, 101, 7, 250, 12, 99, 64, 3, 180, 44, 21], [9], list(range(40, 60))]


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_pallas_logits_match_transformers(hf_checkpoints, name):
    path = hf_checkpoints[name]
    tokens = PROMPTS[0] + PROMPTS[2]
    ours = PagedSequence(load(path, backend="pallas")).feed(tokens)
    np.testing.assert_allclose(ours, hf_logits(path, tokens), rtol=1e-4, atol=1e-4)


def test_pallas_engine_greedy_tokens_match_transformers(hf_checkpoints):
    path = hf_checkpoints["llama"]
    llm = LLM(
        str(path),
        dtype="float32",
        page_size=16,
        num_pages=48,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        max_model_len=128,
        attention_backend="pallas",
    )
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == hf_greedy(path, PROMPTS, 5)
    assert llm.engine.num_recompiles == 0
