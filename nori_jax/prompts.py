"""A prompt's validation and encoding, the same in every frontend (LLMEngine, the core client)."""

from __future__ import annotations

import numpy as np

from nori_jax.tokenizer import Tokenizer


def encode_prompt(
    tokenizer: Tokenizer | None, prompt: str | list[int], vocab_size: int, max_model_len: int
) -> tuple[list[int], str | None]:
    """(token ids, text or None) of a text or token-id prompt; ValueError naming what is wrong."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is empty")
        if tokenizer is None:
            raise ValueError("this model has no tokenizer: pass prompts as lists of token ids")
        token_ids, text = tokenizer.encode(prompt), prompt
    else:
        if not isinstance(prompt, (list, tuple)) or not all(
            isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompt
        ):
            raise ValueError(
                f"prompt must be a string or a list of token ids, got {type(prompt).__name__}"
            )
        if not prompt:
            raise ValueError("prompt is empty (no token ids)")
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(
                f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})"
            )
        token_ids, text = [int(t) for t in prompt], None
    if len(token_ids) >= max_model_len:
        raise ValueError(
            f"prompt has {len(token_ids)} tokens; max_model_len={max_model_len} leaves no room "
            f"to generate"
        )
    return token_ids, text
