"""Building a `Tokenizer` from the vocabulary, merges and special tokens stored in GGUF metadata.

Supported: `tokenizer.ggml.model == "gpt2"`, byte-level BPE (GPT-2, Llama 3, Qwen2, SmolLM, ...).
The vocabulary is stored in the byte-level alphabet already, so it goes into a `tokenizers` BPE
model as is. Tokens typed CONTROL become special added tokens and USER_DEFINED ones plain added
tokens, both matched whole in the raw text (as llama.cpp and transformers do), with the file's ids.

How text is split before BPE is not in the file, only a name for it (`tokenizer.ggml.pre`); the
table below gives, per name, the pre-tokenizer of the original `tokenizer.json`, which is what
llama.cpp reproduces.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors

from nori_jax.tokenizer import Tokenizer

# llama.cpp token types (`enum llama_token_type`)
_CONTROL, _USER_DEFINED = 3, 4

_GPT2 = "gpt2"  # ByteLevel's built-in GPT-2 regex
_DIGITS_GPT2 = "digits+gpt2"  # each digit on its own, then the GPT-2 regex (StarCoder, SmolLM)
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class PreTokenizer(NamedTuple):
    """How a vocabulary's original tokenizer.json cuts text before BPE, and its BPE options."""

    split: str  # _GPT2, _DIGITS_GPT2 or a regex applied before byte-level mapping
    ignore_merges: bool = False  # a pre-token that is itself a token skips the merges (Llama 3)
    add_bos: bool = False  # llama.cpp's default when the file has no add_bos_token


_LLAMA3 = PreTokenizer(_LLAMA3_REGEX, ignore_merges=True, add_bos=True)

# `tokenizer.ggml.pre` as llama.cpp's converter names it -> the original pre-tokenizer
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": PreTokenizer(_GPT2),
    "gpt-2": PreTokenizer(_GPT2),
    "gpt2": PreTokenizer(_GPT2),
    "mpt": PreTokenizer(_GPT2),
    "olmo": PreTokenizer(_GPT2),
    "smollm": PreTokenizer(_DIGITS_GPT2),
    "starcoder": PreTokenizer(_DIGITS_GPT2),
    "refact": PreTokenizer(_DIGITS_GPT2),
    "command-r": PreTokenizer(_DIGITS_GPT2),
    "codeshell": PreTokenizer(_DIGITS_GPT2),
    "llama-bpe": _LLAMA3,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "qwen2": PreTokenizer(_QWEN2_REGEX),
    "deepseek-r1-qwen": PreTokenizer(_QWEN2_REGEX),
}


def tokenizer_from_gguf(metadata: dict[str, Any], path: Path) -> Tokenizer:
    """The tokenizer described by a GGUF file's `tokenizer.*` metadata."""
    where = str(path)
    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"{where!r}: tokenizer.ggml.model={kind!r} is not supported, only 'gpt2' (byte BPE)"
        )
    tokens: list[str] = metadata.get("tokenizer.ggml.tokens") or []
    merges: list[str] = metadata.get("tokenizer.ggml.merges") or []
    if not tokens or not merges:
        raise ValueError(
            f"{where!r}: a byte-level BPE tokenizer needs tokenizer.ggml.tokens and .merges"
        )
    token_types: list[int] = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(token_types) != len(tokens):
        raise ValueError(f"{where!r}: {len(token_types)} token types for {len(tokens)} tokens")

    pre_name = metadata.get("tokenizer.ggml.pre", "default")
    pre = PRE_TOKENIZERS.get(pre_name)
    if pre is None:
        # a guess would tokenize differently from the model's training without any error
        known = sorted(PRE_TOKENIZERS)
        raise ValueError(f"{where!r}: tokenizer.ggml.pre={pre_name!r} is not known; known: {known}")
    backend = _bpe_backend(tokens, token_types, _split_merges(merges, where), pre)

    def token_at(key: str) -> tuple[int | None, str | None]:
        tid = metadata.get(f"tokenizer.ggml.{key}")
        if tid is None:
            return None, None
        if not 0 <= tid < len(tokens):
            raise ValueError(f"{where!r}: tokenizer.ggml.{key}={tid} is outside the vocabulary")
        return tid, tokens[tid]

    bos_id, bos = token_at("bos_token_id")
    eos_id, eos = token_at("eos_token_id")
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", pre.add_bos))
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    if (add_bos and bos is None) or (add_eos and eos is None):
        raise ValueError(
            f"{where!r}: add_bos_token/add_eos_token is set but the token id is missing"
        )
    backend.post_processor = _post_processor(
        bos if add_bos else None, bos_id, eos if add_eos else None, eos_id
    )

    # end-of-generation: EOS plus the end-of-turn/message tokens Llama 3 declares separately
    eos_ids = [
        tid for k in ("eos", "eot", "eom") if (tid := token_at(f"{k}_token_id")[0]) is not None
    ]
    return Tokenizer(
        backend=backend,
        bos_token_id=bos_id,
        eos_token_ids=tuple(dict.fromkeys(eos_ids)),
        chat_template=metadata.get("tokenizer.chat_template"),
        bos_token=bos,
        eos_token=eos,
        unk_token=token_at("unknown_token_id")[1],
        pad_token=token_at("padding_token_id")[1],
    )


def _bpe_backend(
    tokens: list[str], token_types: list[int], merges: list[tuple[str, str]], pre: PreTokenizer
) -> tokenizers.Tokenizer:
    backend = tokenizers.Tokenizer(
        models.BPE(
            vocab=_vocab(tokens),
            merges=merges,
            fuse_unk=False,
            byte_fallback=False,
            ignore_merges=pre.ignore_merges,
        )
    )
    backend.pre_tokenizer = _pre_tokenizer(pre.split)
    backend.decoder = decoders.ByteLevel()
    # adding a token whose text the vocabulary has keeps the vocabulary's id: the file's ids hold
    typed = list(zip(tokens, token_types, strict=True))
    backend.add_special_tokens([_added(t, special=True) for t, k in typed if k == _CONTROL])
    backend.add_tokens([_added(t, special=False) for t, k in typed if k == _USER_DEFINED])
    return backend


def _vocab(tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        # a duplicated string keeps its first id, like llama.cpp's text-to-id lookup
        vocab.setdefault(token, i)
    return vocab


def _split_merges(merges: list[str], where: str) -> list[tuple[str, str]]:
    pairs = []
    for rank, merge in enumerate(merges):
        left, sep, right = merge.partition(" ")
        if not sep or not left or not right or " " in right:
            raise ValueError(
                f"{where!r}: merge #{rank} {merge!r} is not two tokens joined by a space"
            )
        pairs.append((left, right))
    return pairs


def _pre_tokenizer(split: str) -> pre_tokenizers.PreTokenizer:
    if split == _GPT2:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if split == _DIGITS_GPT2:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(tokenizers.Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _post_processor(
    bos: str | None, bos_id: int | None, eos: str | None, eos_id: int | None
) -> processors.TemplateProcessing:
    """`encode(text)` with special tokens: [BOS] text [EOS], as the file's add_*_token flags ask."""

    def template(sequence: str, type_id: int) -> list[str]:
        parts = [p for p in (bos, sequence, eos) if p is not None]
        return [f"{p}:{type_id}" for p in parts]

    special = [(t, i) for t, i in ((bos, bos_id), (eos, eos_id)) if t is not None]
    return processors.TemplateProcessing(
        single=template("$A", 0),
        pair=template("$A", 0) + template("$B", 1),
        special_tokens=list(dict.fromkeys(special)),
    )


def _added(content: str, special: bool) -> tokenizers.AddedToken:
    return tokenizers.AddedToken(content, special=special, normalized=False)
