"""The embedded SmolLM2-135M-Instruct GGUF: our engine against transformers on the same file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from model_harness import PagedSequence, load

from nori_jax import LLM, SamplingParams

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Name three primary colors."},
    ],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a fun fact about octopuses."},
    ],
]
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def llm() -> LLM:
    # Two token buckets (16, 32) keep the 30-layer compile short on CI's CPUs.
    return LLM(
        dtype="float32",
        page_size=16,
        num_pages=160,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        max_model_len=512,
    )


def test_float32_logits_close(embedded_path: Path, hf_model, llm):
    ids = llm.tokenizer.encode_chat(CHATS[1])
    ours = PagedSequence(load(embedded_path), max_len=256).feed(ids)
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(ours, ref, rtol=1e-3, atol=2e-3)
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_greedy_chat_tokens_identical(hf_model, llm):
    outs = llm.chat(CHATS, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    for conv, out in zip(CHATS, outs, strict=True):
        ids = llm.tokenizer.encode_chat(conv)
        with torch.no_grad():
            ref = hf_model.generate(
                torch.tensor([ids]),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                min_new_tokens=NEW_TOKENS,
                eos_token_id=None,
                pad_token_id=0,
            )
        assert out.token_ids == ref[0, len(ids) :].tolist(), conv
    assert llm.engine.num_recompiles == 0


def test_capital_of_france_is_paris(llm):
    out = llm.chat(CHATS[0], SamplingParams(max_tokens=20, temperature=0.0))[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # the model ends its turn by itself
