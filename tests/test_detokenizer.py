"""Streamed text: the detokenizer's pieces, joined, are exactly the text the output adds to the
prompt's, for byte-level BPE (characters split across byte tokens) and sentencepiece-style
(leading-space) tokenizers, with and without special tokens."""

from __future__ import annotations

import pytest
import tokenizers
from tokenizers import SentencePieceBPETokenizer

from nori_jax.dummy_tokenizer import byte_tokenizer
from nori_jax.tokenizer import IncrementalDetokenizer, Tokenizer
from nori_jax.weights.default_model import default_model_path
from nori_jax.weights.gguf_file import read_gguf_file
from nori_jax.weights.gguf_tokenizer import tokenizer_from_gguf

TEXTS = [
    "The capital of France is Paris.",
    "Ünïcödé, 日本語 and emojis 🎉🎉, split across byte tokens.",
    "def f(x):\n    return x ** 2  # tabs\tand  double  spaces\n",
]


def _embedded() -> Tokenizer:
    path = default_model_path()
    return tokenizer_from_gguf(read_gguf_file(path).metadata, path)


def _sentencepiece_style() -> Tokenizer:
    """Metaspace pre-tokenizer and decoder: a word's leading space lives in its first piece."""
    sp = SentencePieceBPETokenizer()
    sp.train_from_iterator(TEXTS[:1] * 20 + ["Paris is the capital. France is big."] * 20, 120)
    sp.add_special_tokens(["<eos>"])
    backend = tokenizers.Tokenizer.from_str(sp._tokenizer.to_str())
    return Tokenizer(backend=backend, bos_token_id=None, eos_token_ids=())


TOKENIZERS = {
    "embedded-smollm2": _embedded,
    "byte-dummy": lambda: byte_tokenizer(512),
    "sentencepiece-style": _sentencepiece_style,
}


def _streamed(tok: Tokenizer, prompt: list[int], ids: list[int], skip: bool) -> str:
    detok = IncrementalDetokenizer(tok, prompt, skip)
    pieces = [detok.add(i) for i in ids]
    assert "".join(pieces) == detok.text
    return detok.text


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_is_what_the_output_adds(name: str, text: str):
    tok = TOKENIZERS[name]()
    if name == "sentencepiece-style":
        text = "Paris is the capital. France is big."  # inside its tiny vocabulary
    prompt = tok.encode("The capital of France is", add_special_tokens=False)
    ids = tok.encode(" " + text, add_special_tokens=False)
    whole = tok.decode(prompt + ids)
    before = tok.decode(prompt)
    assert whole.startswith(before)
    assert _streamed(tok, prompt, ids, True) == whole[len(before) :]


def test_leading_space_survives_after_a_prompt():
    """Decoded alone, a sentencepiece sequence drops its first space; after a prompt it must not."""
    tok = _sentencepiece_style()
    prompt = tok.encode("France is", add_special_tokens=False)
    ids = tok.encode(" big", add_special_tokens=False)
    assert not tok.decode(ids).startswith(" ")
    assert _streamed(tok, prompt, ids, True) == " big"


def test_empty_prompt_and_special_tokens():
    tok = _embedded()
    eos = tok.eos_token_ids[0]
    ids = tok.encode("Hi there", add_special_tokens=False) + [eos]
    assert _streamed(tok, [], ids, True) == "Hi there"
    assert _streamed(tok, [], ids, False) == tok.decode(ids, skip_special_tokens=False)


def test_incomplete_character_is_held_back():
    """A 4-byte emoji arrives one byte token at a time: nothing until its last byte."""
    tok = byte_tokenizer(512)
    ids = tok.encode("a🎉", add_special_tokens=False)
    assert len(ids) == 5
    detok = IncrementalDetokenizer(tok, [])
    assert [detok.add(i) for i in ids] == ["a", "", "", "", "🎉"]


def test_bytes_that_never_complete_a_character_are_flushed_at_the_end():
    """A run of invalid UTF-8 bytes streams nothing; at the end they become U+FFFD, so the whole
    text is what decoding every token at once gives."""
    tok = byte_tokenizer(512)
    detok = IncrementalDetokenizer(tok, tok.encode("hi", add_special_tokens=False))
    assert [detok.add(0xFF) for _ in range(3)] == ["", "", ""]
    assert detok.flush() == tok.decode([0xFF] * 3) == "\ufffd" * 3
    assert detok.flush() == "" and detok.text == "\ufffd" * 3
    # a truncated emoji after text: the text streams, the partial character comes at the end
    ids = tok.encode("a🎉", add_special_tokens=False)[:-1]
    detok = IncrementalDetokenizer(tok, [])
    assert "".join(detok.add(i) for i in ids) == "a"
    tail = detok.flush()
    assert tail.startswith("\ufffd") and detok.text == "a" + tail == tok.decode(ids)


def test_a_streamed_output_of_invalid_bytes_still_carries_its_text():
    """Through the output processor: a request whose every token is an invalid byte ends with
    its text in the final delta and in the finished output (not an empty stream)."""
    import numpy as np

    from nori_jax.core.output_processor import OutputProcessor
    from nori_jax.core.outputs import EngineCoreOutputs, FinishedRequest, RequestMetrics
    from nori_jax.sampling_params import SamplingParams

    tok = byte_tokenizer(512)
    proc = OutputProcessor(tok)
    proc.add("r", None, [104, 105], SamplingParams(max_tokens=3), stream=True)
    deltas = ""
    final = FinishedRequest("r", "length", 2, 3, RequestMetrics(*[None] * 5, 0, 0))
    for step in range(3):
        done = [final] if step == 2 else []
        outs = EngineCoreOutputs(["r"], np.int32([0xFE]).tobytes(), b"", done, [])
        emitted, ended = proc.process(outs)
        assert not ended
        deltas += "".join(o.new_text for o in emitted)
    assert emitted[-1].finished and emitted[-1].finish_reason == "length"
    assert deltas == emitted[-1].text == tok.decode([0xFE] * 3) == "\ufffd" * 3
