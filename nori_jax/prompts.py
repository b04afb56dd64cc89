"""A prompt's validation and encoding, the same in every frontend (LLMEngine, the core client).

Errors are `ParameterError("prompt", ...)`. A text prompt far longer than the model length is
refused before it is tokenized (`max_prompt_bytes`), so a huge prompt costs a length check, not
seconds of tokenizer time.
"""

from __future__ import annotations

import numpy as np

from nori_jax.sampling_params import ParameterError
from nori_jax.tokenizer import Tokenizer

# Normalizers may compose characters (NFC/NFKC: a letter and its combining accent become one), so
# a text's UTF-8 length can exceed the sum of its tokens' lengths; this factor leaves room for it.
_NORMALIZATION_SLACK = 4


def max_prompt_bytes(tokenizer: Tokenizer, max_model_len: int) -> int:
    """A text longer than this (in UTF-8 bytes) cannot encode to fewer than max_model_len tokens."""
    return max_model_len * tokenizer.longest_token_bytes * _NORMALIZATION_SLACK


def lone_surrogate(text: str) -> str | None:
    """Why `text` is not Unicode text, or None. JSON's escapes can spell a lone surrogate
    ("\\ud800"), which a Python str holds but UTF-8 cannot encode and tokenizers refuse."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"has a lone surrogate {text[e.start]!r} at character {e.start}: not Unicode text"
    return None


def encode_prompt(
    tokenizer: Tokenizer | None, prompt: str | list[int], vocab_size: int, max_model_len: int
) -> tuple[list[int], str | None]:
    """(token ids, text or None) of a text or token-id prompt (a list, or a 1-D integer array);
    ParameterError naming the fault."""
    if isinstance(prompt, str):
        if not prompt:
            raise ParameterError("prompt", "prompt is empty")
        if tokenizer is None:
            raise ParameterError(
                "prompt", "this model has no tokenizer: pass prompts as lists of token ids"
            )
        if (why := lone_surrogate(prompt)) is not None:
            raise ParameterError("prompt", f"the prompt {why}")
        check_text_length(tokenizer, prompt, max_model_len)
        token_ids, text = tokenizer.encode(prompt), prompt
    else:
        if not isinstance(prompt, (list, tuple, bytes, bytearray)) and hasattr(prompt, "__array__"):
            ids = np.asarray(prompt)  # numpy or JAX token ids
            if ids.ndim == 1 and np.issubdtype(ids.dtype, np.integer):
                prompt = ids.tolist()
        if not isinstance(prompt, (list, tuple)) or not all(
            isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompt
        ):
            raise ParameterError(
                "prompt",
                f"prompt must be a string or a list of token ids, got {type(prompt).__name__}",
            )
        if not prompt:
            raise ParameterError("prompt", "prompt is empty (no token ids)")
        check_length(len(prompt), max_model_len)
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise ParameterError(
                "prompt",
                f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})",
            )
        token_ids, text = [int(t) for t in prompt], None
    check_length(len(token_ids), max_model_len)
    return token_ids, text


def check_text_length(tokenizer: Tokenizer, text: str, max_model_len: int) -> None:
    """Refuse, without tokenizing it, a text too long to fit the model length."""
    # A character is at most 4 UTF-8 bytes: most texts pass on their length alone.
    limit = max_prompt_bytes(tokenizer, max_model_len)
    if len(text) * 4 > limit and len(text.encode()) > limit:
        raise ParameterError(
            "prompt",
            f"the prompt has {len(text.encode())} bytes of text, more than {max_model_len} "
            f"tokens (max_model_len) can hold",
        )


def check_length(num_tokens: int, max_model_len: int) -> None:
    if num_tokens >= max_model_len:
        raise ParameterError(
            "prompt",
            f"prompt has {num_tokens} tokens; max_model_len={max_model_len} leaves no room "
            f"to generate",
        )
