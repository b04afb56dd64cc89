"""Prompts with a chosen number of input tokens, counted the way the server will count them.

With a tokenizer: text is random ordinary vocabulary, re-encoded and trimmed/extended until the
server-side count is exact. That count is `encode(text)` with special tokens for /v1/completions
(the post-processor's BOS included, as servers tokenize completions prompts), and
`encode(chat_template(user: text))` without them for /v1/chat/completions (the template writes BOS
itself). Token-id prompts (/v1/completions only) are exact by construction: the server receives the
list as is. Without a tokenizer, prompts are common English words, about one token each, and the
count is only an estimate that the run checks against the server's `usage.prompt_tokens`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from nori_jax.bench.config import EndpointKind
from nori_jax.tokenizer import Tokenizer

# Sampling a slice of a 150k vocabulary is plenty for randomness and keeps start-up under a second.
_POOL_SAMPLE = 20_000
# Adjustment rounds before trying token swaps at the end; one round suffices for byte-level BPE
# because space-led word tokens re-encode independently of their neighbours.
_MAX_ADJUST_ROUNDS = 16
_MAX_SWAPS = 64


@dataclasses.dataclass(frozen=True)
class Prompt:
    prompt: str | list[int]  # text (completions prompt or chat user message) or token ids
    num_tokens: int  # exact server-side count when `exact`, else an estimate
    exact: bool


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of a Hugging Face directory (or its tokenizer.json), or of a GGUF file."""
    path = Path(path)
    if path.suffix == ".gguf":
        # the engine's own reader: the metadata only, tensors stay on disk
        from nori_jax.weights.gguf_file import read_gguf_file
        from nori_jax.weights.gguf_tokenizer import tokenizer_from_gguf

        return tokenizer_from_gguf(read_gguf_file(path).metadata, path)
    if path.is_file() and path.name == "tokenizer.json":
        path = path.parent
    return Tokenizer.from_hf_dir(path)


class TokenizerPrompts:
    """Builds exact-length prompts from one tokenizer for one endpoint."""

    def __init__(self, tokenizer: Tokenizer, endpoint: EndpointKind) -> None:
        self.tokenizer = tokenizer
        self.endpoint = endpoint
        self.pool = _ordinary_token_pool(tokenizer)  # [V'] int64
        if endpoint == "chat" and tokenizer.chat_template is None:
            raise ValueError("/v1/chat/completions needs a tokenizer with a chat template")
        # Specials the completions post-processor puts around any text (BOS, rarely EOS); a
        # token-id prompt carries the same ones so it looks like an encoded text prompt.
        with_sp = tokenizer.encode("a", add_special_tokens=True)
        plain = tokenizer.encode("a", add_special_tokens=False)
        at = next(i for i in range(len(with_sp)) if with_sp[i : i + len(plain)] == plain)
        self._prefix, self._suffix = with_sp[:at], with_sp[at + len(plain) :]
        self.min_tokens = self.count("")

    def count(self, text: str) -> int:
        return self.count_batch([text])[0]

    def count_batch(self, texts: list[str]) -> list[int]:
        """Server-side token counts; one parallel encode for the whole batch."""
        if self.endpoint == "chat":
            render = self.tokenizer.apply_chat_template
            texts = [render([{"role": "user", "content": t}]) for t in texts]
        specials = self.endpoint == "completions"
        encoded = self.tokenizer.backend.encode_batch(texts, add_special_tokens=specials)
        return [len(e.ids) for e in encoded]

    def text(self, num_tokens: int, rng: np.random.Generator) -> Prompt:
        """Text whose server-side count is `num_tokens` (or the nearest reachable count)."""
        return self.texts([num_tokens], rng)[0]

    def texts(self, num_tokens: list[int], rng: np.random.Generator) -> list[Prompt]:
        """One prompt per target count. The first render of every prompt is batched (decode and
        encode run in parallel in the tokenizer's Rust core); nearly all are exact after it."""
        targets = [max(n, self.min_tokens + 1) for n in num_tokens]
        ids = [list(rng.choice(self.pool, size=t - self.min_tokens)) for t in targets]
        decoded = self.tokenizer.backend.decode_batch(
            [[int(t) for t in x] for x in ids], skip_special_tokens=True
        )
        counts = self.count_batch(decoded)
        return [
            Prompt(text, count, exact=True) if count == target else self._adjust(x, target, rng)
            for x, text, count, target in zip(ids, decoded, counts, targets, strict=True)
        ]

    def _adjust(self, ids: list[int], target: int, rng: np.random.Generator) -> Prompt:
        """Trim or extend until the count is exact: a token merged across a word boundary."""
        text, count = self._render(ids)
        for _ in range(_MAX_ADJUST_ROUNDS):
            if count == target:
                return Prompt(text, count, exact=True)
            if count < target:
                ids.extend(rng.choice(self.pool, size=target - count))
            elif len(ids) > 1:
                ids = ids[: max(1, len(ids) - (count - target))]
            else:
                break
            text, count = self._render(ids)
        # Merges across a word boundary can make the count oscillate; swapping the last token
        # for another word breaks the tie. The count returned is always the true one.
        for _ in range(_MAX_SWAPS):
            if count == target:
                break
            ids[-1] = rng.choice(self.pool)
            text, count = self._render(ids)
        return Prompt(text, count, exact=True)

    def token_ids(self, num_tokens: int, rng: np.random.Generator) -> Prompt:
        """A token-id prompt of exactly `num_tokens` ids (at least the special tokens)."""
        n_random = max(num_tokens - len(self._prefix) - len(self._suffix), 0)
        body = [int(t) for t in rng.choice(self.pool, size=n_random)]
        ids = self._prefix + body + self._suffix
        return Prompt(ids, len(ids), exact=True)

    def _render(self, ids: list[int]) -> tuple[str, int]:
        text = self.tokenizer.decode([int(t) for t in ids], skip_special_tokens=True)
        return text, self.count(text)


def _ordinary_token_pool(tokenizer: Tokenizer) -> np.ndarray:
    """Ids of word-like, non-special tokens that decode and re-encode to themselves."""
    backend = tokenizer.backend
    added = set(backend.get_added_tokens_decoder())
    ids = np.array(sorted(set(backend.get_vocab(with_added_tokens=False).values()) - added))
    if len(ids) > _POOL_SAMPLE:  # a fixed seed: the pool must not depend on the run's seed
        ids = np.sort(np.random.default_rng(0).choice(ids, _POOL_SAMPLE, replace=False))
    texts = backend.decode_batch([[int(i)] for i in ids], skip_special_tokens=True)
    round_trip = backend.encode_batch(texts, add_special_tokens=False)
    alpha: list[int] = []
    spaced: list[int] = []  # " word" tokens: byte-level BPE re-encodes them independently
    for tid, text, enc in zip(ids, texts, round_trip, strict=True):
        word = text.strip()
        if not word.isalpha() or enc.ids != [int(tid)]:
            continue
        alpha.append(int(tid))
        if text.startswith(" ") and text[1:] == word:
            spaced.append(int(tid))
    for pool in (spaced, alpha):
        if len(pool) >= 64:
            return np.array(pool, dtype=np.int64)
    if len(ids) == 0:
        raise ValueError("the tokenizer has no ordinary tokens to build prompts from")
    return ids.astype(np.int64)  # a toy vocabulary: the adjust loop copes with any tokens


# Short, frequent English words: one token each (with the leading space) in the GPT-2, Llama-3,
# Qwen2, Mistral and SmolLM2 vocabularies, so a word count is a fair token estimate.
_WORDS = (
    "the of and to in is was for on are with as at be by this had not but from or have an they "
    "which one you were her all she there would their we him been has when who will more no if "
    "out so said what up its about into than them can only other new some could time these two "
    "may then do first any my now such like our over man me even most made after also did many "
    "before must through back years where much your way well down should because each just "
    "those people how too little state good very make world still own see men work long get "
    "here between both life being under never day same another know while last might us great "
    "old year off come since against go came right used take three"
).split()


class WordPrompts:
    """No tokenizer: a run of common words, one estimated token each (plus one for a BOS)."""

    endpoint: EndpointKind

    def __init__(self, endpoint: EndpointKind) -> None:
        self.endpoint = endpoint

    def text(self, num_tokens: int, rng: np.random.Generator) -> Prompt:
        words = rng.choice(len(_WORDS), size=max(num_tokens - 1, 1))
        return Prompt(" ".join(_WORDS[i] for i in words), num_tokens, exact=False)

    def texts(self, num_tokens: list[int], rng: np.random.Generator) -> list[Prompt]:
        return [self.text(n, rng) for n in num_tokens]
