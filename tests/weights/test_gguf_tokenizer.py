"""The embedded SmolLM2 GGUF's tokenizer and chat template against transformers on the same file."""

from __future__ import annotations

from typing import Any

import pytest
from tokenizers import pre_tokenizers

TEXTS = [
    "",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "I'm sure they'll say it's fine, don't you think? WE'VE SEEN IT.",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < n; ++i) { sum += a[i] * 0x1F; }  // done",
    "Numbers 12345 and 3.14159 and 1,000,000 (x2)",
    "Café naïve résumé façade Ångström — “quotes” Ω ∑ ∞",
    "你好，世界！这是一个测试。日本語のテキストとカタカナ。한국어 텍스트입니다",
    "Emoji: 😀👍🏽🇺🇸 ❤️‍🔥 👨‍👩‍👧 and more",
    "  leading and trailing  ",
    "tabs\tand\nnewlines\r\n\n\nmixed",
    "a     b\n\n\n\nc",
    "\n\n\n",
    "    ",
    "<|im_start|>user\nHi there<|im_end|>\n",
    "text<|endoftext|>more text",
    "<|im_start|><|im_end|><repo_name>",
    "not special: <|im_start and |im_end|>",
]

# Numbers after whitespace: SmolLM2's own tokenizer.json splits every numeric character off first
# (Digits(individual_digits=True), then ByteLevel), as llama.cpp's "smollm" pre-tokenizer does and
# we do. transformers' GGUF loader drops that step for "smollm" files, so it reads "\n\n1" as
# "\n" + "\n1" and " ½" as the merge "Ġ½". On these texts it differs from the model's real
# tokenizer; we follow the real one.
NUMBERS_AFTER_WHITESPACE = [
    "List:\n\n1. one\n2. two",
    "x  42",
    "a\t\t7",
    "   1000   2000",
    "a ½ cup",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name three primes."},
    ],
    [
        {"role": "system", "content": "You answer in French."},
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "Bonjour ! Comment puis-je vous aider ?"},
        {"role": "user", "content": "Quelle heure est-il ?"},
    ],
    [
        {"role": "user", "content": "Write code:\n```python\nprint('hi')\n```"},
        {"role": "assistant", "content": "def f(x):\n    return x * 2  # 😀"},
        {"role": "user", "content": "你好，解释一下。"},
    ],
]


def _reference_tokenizer(hf_tok: Any) -> Any:
    """transformers' tokenizer with the pre-tokenizer of SmolLM2's original tokenizer.json."""
    backend = hf_tok.backend_tokenizer.__class__.from_str(hf_tok.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    return backend


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_token_ids_match_transformers(ours, hf_tok, add_special_tokens: bool):
    for text in TEXTS:
        want = hf_tok(text, add_special_tokens=add_special_tokens)["input_ids"]
        assert ours.tokenizer.encode(text, add_special_tokens) == want, text


def test_numbers_after_whitespace_follow_the_original_tokenizer(ours, hf_tok):
    reference = _reference_tokenizer(hf_tok)
    for text in TEXTS + NUMBERS_AFTER_WHITESPACE:
        assert ours.tokenizer.encode(text) == reference.encode(text).ids, text
    # "\n\n" is one token when digits are split off first, as in the model's training
    assert hf_tok.convert_tokens_to_ids("ĊĊ") in ours.tokenizer.encode("List:\n\n1. one")


def test_special_tokens(ours, hf_tok):
    tok = ours.tokenizer
    assert tok.bos_token_id == hf_tok.bos_token_id == 1
    assert tok.eos_token_ids == (hf_tok.eos_token_id,) == (2,)
    assert (tok.bos_token, tok.eos_token) == (hf_tok.bos_token, hf_tok.eos_token)
    assert (tok.unk_token, tok.pad_token) == (hf_tok.unk_token, hf_tok.pad_token)
    assert tok.vocab_size == len(hf_tok) == 49152
    assert tok.encode("<|im_end|>") == [2]


def test_decode_matches_transformers_and_round_trips(ours, hf_tok):
    tok = ours.tokenizer
    for text in TEXTS + NUMBERS_AFTER_WHITESPACE:
        ids = tok.encode(text)
        assert tok.decode(ids, skip_special_tokens=False) == text
        for skip in (True, False):
            assert tok.decode(ids, skip) == hf_tok.decode(ids, skip_special_tokens=skip), text
    assert tok.decode(tok.encode("a<|im_end|>b"), skip_special_tokens=True) == "ab"


@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
def test_chat_template_matches_transformers(ours, hf_tok, index: int):
    messages = CONVERSATIONS[index]
    for add_generation_prompt in (True, False):
        text = hf_tok.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False
        )
        assert ours.tokenizer.apply_chat_template(messages, add_generation_prompt) == text
    want = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
    assert ours.tokenizer.encode_chat(messages) == list(want)


def test_chat_template_from_metadata(ours):
    assert ours.tokenizer.chat_template == ours.file.metadata["tokenizer.chat_template"]
    prompt = ours.tokenizer.apply_chat_template(CONVERSATIONS[0])
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")
