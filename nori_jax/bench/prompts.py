"""The requests of a `bench serve` run: prompts of a chosen number of tokens, counted as the server
will count them.

With a tokenizer, text is random ordinary vocabulary, re-encoded and trimmed or extended until the
server-side count is exact: `encode(text)` with special tokens for /v1/completions (the
post-processor's BOS included, as servers tokenize completions prompts), and
`encode(chat_template(user: text))` without them for /v1/chat/completions (the template writes
BOS itself). Token-id prompts (/v1/completions only) are exact by construction. Without a
tokenizer, prompts are common English words, about one token each: an estimate that the run
replaces with the server's `usage.prompt_tokens`.

The tokenizer is `--tokenizer`, or else the one the server's `/v1/models` card names: a local
HF directory or GGUF file, this engine's shape presets (byte-level) and embedded model, or a model
in the local Hugging Face cache.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from nori_jax.bench.workload import WorkloadConfig
from nori_jax.tokenizer import Tokenizer

# A slice of a 150k vocabulary is plenty of randomness and keeps start-up under a second.
_POOL_SAMPLE = 20_000
_MAX_ADJUST_ROUNDS = 16  # one suffices for byte-level BPE: space-led words re-encode alone
_MAX_SWAPS = 64


@dataclasses.dataclass(frozen=True)
class BenchRequest:
    index: int  # negative for warm-up requests
    prompt: str | list[int]  # completions prompt text or token ids, or the chat user message
    prompt_len: int  # the server's count when `exact`, else the client's estimate
    exact: bool
    output_len: int  # max_tokens


class Prompt(NamedTuple):
    prompt: str | list[int]
    num_tokens: int
    exact: bool


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of a Hugging Face directory (or its tokenizer.json), or of a GGUF file."""
    path = Path(path).expanduser()
    if path.suffix == ".gguf":
        from nori_jax.weights.gguf_file import read_gguf_file
        from nori_jax.weights.gguf_tokenizer import tokenizer_from_gguf

        return tokenizer_from_gguf(read_gguf_file(path).metadata, path)  # metadata only
    if path.name == "tokenizer.json":
        path = path.parent
    return Tokenizer.from_hf_dir(path)


def served_tokenizer(card: dict[str, Any]) -> tuple[Tokenizer, str] | None:
    """The tokenizer of the model a server's /v1/models card names, with where it came from."""
    from nori_jax.model_config import list_presets, load_preset

    ours = card.get("owned_by") == "nori-jax"
    for name in dict.fromkeys(str(n) for n in (card.get("root"), card.get("id")) if n):
        path = Path(name).expanduser()
        if (path.suffix == ".gguf" and path.is_file()) or (path / "tokenizer.json").is_file():
            return load_tokenizer(path), str(path)
        if ours and name in list_presets():
            from nori_jax.dummy_tokenizer import byte_tokenizer

            tok = byte_tokenizer(int(load_preset(name)["vocab_size"]))
            return tok, f"preset {name} (byte-level)"
        if ours and name == _embedded_model_name():
            from nori_jax.weights.default_model import default_model_path

            path = default_model_path()
            return load_tokenizer(path), str(path)
        snapshot = _hf_cache_snapshot(name)
        if snapshot is not None:
            return load_tokenizer(snapshot), str(snapshot)
    return None


def _embedded_model_name() -> str:
    from serve.cli import DEFAULT_MODEL_NAME

    return DEFAULT_MODEL_NAME


def _hf_cache_snapshot(repo_id: str) -> Path | None:
    """A downloaded snapshot of a Hugging Face model that has a tokenizer.json (no network)."""
    if repo_id.count("/") != 1:
        return None
    home = Path(os.environ.get("HF_HOME", "~/.cache/huggingface")).expanduser()
    hub = Path(os.environ.get("HF_HUB_CACHE", home / "hub"))
    snapshots = hub / f"models--{repo_id.replace('/', '--')}" / "snapshots"
    found = sorted(snapshots.glob("*/tokenizer.json"), key=lambda p: p.stat().st_mtime)
    return found[-1].parent if found else None


class TokenizerPrompts:
    """Builds exact-length prompts from one tokenizer for one endpoint ('completions', 'chat')."""

    def __init__(self, tokenizer: Tokenizer, endpoint: str) -> None:
        self.tokenizer, self.endpoint = tokenizer, endpoint
        self.pool = _ordinary_token_pool(tokenizer)
        if endpoint == "chat" and tokenizer.chat_template is None:
            raise ValueError("/v1/chat/completions needs a tokenizer with a chat template")
        # Specials the completions post-processor puts around any text (BOS, rarely EOS); a
        # token-id prompt carries the same ones so it looks like an encoded text prompt.
        with_sp = tokenizer.encode("a", add_special_tokens=True)
        plain = tokenizer.encode("a", add_special_tokens=False)
        at = next(i for i in range(len(with_sp)) if with_sp[i : i + len(plain)] == plain)
        self._prefix, self._suffix = with_sp[:at], with_sp[at + len(plain) :]
        self.min_tokens = self.count([""])[0]

    def count(self, texts: list[str]) -> list[int]:
        """Server-side token counts, in one parallel encode."""
        if self.endpoint == "chat":
            render = self.tokenizer.apply_chat_template
            texts = [render([{"role": "user", "content": t}]) for t in texts]
        specials = self.endpoint == "completions"
        return [
            len(e.ids)
            for e in self.tokenizer.backend.encode_batch(texts, add_special_tokens=specials)
        ]

    def texts(self, num_tokens: list[int], rng: np.random.Generator) -> list[Prompt]:
        """One prompt per target count; the first render of all of them is one batched decode
        and encode (the tokenizer's Rust core runs them in parallel), and nearly all are exact."""
        targets = [max(n, self.min_tokens + 1) for n in num_tokens]
        ids = [[int(t) for t in rng.choice(self.pool, size=n - self.min_tokens)] for n in targets]
        texts = self.tokenizer.backend.decode_batch(ids, skip_special_tokens=True)
        return [
            Prompt(text, n, True) if got == n else self._adjust(x, n, rng)
            for x, text, got, n in zip(ids, texts, self.count(texts), targets, strict=True)
        ]

    def _adjust(self, ids: list[int], target: int, rng: np.random.Generator) -> Prompt:
        """Trim or extend until the count is exact (a token merged across a word boundary)."""
        text, count = self._render(ids)
        for _ in range(_MAX_ADJUST_ROUNDS):
            if count == target or (count > target and len(ids) == 1):
                break
            if count < target:
                ids.extend(int(t) for t in rng.choice(self.pool, size=target - count))
            else:
                ids = ids[: max(1, len(ids) - (count - target))]
            text, count = self._render(ids)
        for _ in range(_MAX_SWAPS):  # counts that oscillate: another last word breaks the tie
            if count == target:
                break
            ids[-1] = int(rng.choice(self.pool))
            text, count = self._render(ids)
        return Prompt(text, count, True)  # the true count, even if no swap reached the target

    def token_ids(self, num_tokens: int, rng: np.random.Generator) -> Prompt:
        """Exactly `num_tokens` ids (at least the special tokens), BOS first where text has it."""
        n_random = max(num_tokens - len(self._prefix) - len(self._suffix), 0)
        ids = self._prefix + [int(t) for t in rng.choice(self.pool, size=n_random)] + self._suffix
        return Prompt(ids, len(ids), True)

    def _render(self, ids: list[int]) -> tuple[str, int]:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return text, self.count([text])[0]


def _ordinary_token_pool(tokenizer: Tokenizer) -> np.ndarray:
    """Ids of word-like, non-special tokens that decode and re-encode to themselves."""
    backend = tokenizer.backend
    added = set(backend.get_added_tokens_decoder())
    ids = np.array(sorted(set(backend.get_vocab(with_added_tokens=False).values()) - added))
    if len(ids) > _POOL_SAMPLE:  # a fixed seed: the pool must not depend on the run's seed
        ids = np.sort(np.random.default_rng(0).choice(ids, _POOL_SAMPLE, replace=False))
    texts = backend.decode_batch([[int(i)] for i in ids], skip_special_tokens=True)
    round_trip = backend.encode_batch(texts, add_special_tokens=False)
    alpha, spaced = [], []  # spaced: " word" tokens, which byte-level BPE re-encodes alone
    for tid, text, enc in zip(ids.tolist(), texts, round_trip, strict=True):
        if text.strip().isalpha() and enc.ids == [tid]:
            alpha.append(tid)
            if text.startswith(" ") and text[1:] == text.strip():
                spaced.append(tid)
    for pool in (spaced, alpha):
        if len(pool) >= 32:  # a byte-level vocabulary has its 52 letters
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


def word_prompts(num_tokens: list[int], rng: np.random.Generator) -> list[Prompt]:
    """No tokenizer: common words, one estimated token each (plus one for a BOS)."""
    return [
        Prompt(" ".join(_WORDS[i] for i in rng.choice(len(_WORDS), size=max(n - 1, 1))), n, False)
        for n in num_tokens
    ]


def build_requests(
    w: WorkloadConfig,
    prompts: TokenizerPrompts | None,
    token_ids: bool,
    num: int,
    rng: np.random.Generator,
    first_index: int = 0,
    content_rng: np.random.Generator | None = None,
) -> list[BenchRequest]:
    """`num` requests; the rng alone decides lengths and tokens, so a seed fixes the workload.

    content_rng, when given, draws the prompts' tokens instead: the same lengths with other
    content (a sweep's later rates, so a prefix-caching server cannot reuse earlier prompts).
    """
    if w.dataset == "jsonl":
        assert w.path is not None  # WorkloadConfig checks it
        return _jsonl_requests(Path(w.path), w.output_len, prompts, token_ids, num, first_index)
    input_lens, output_lens = w.lengths(num, rng)
    rng = content_rng or rng
    if token_ids:
        assert prompts is not None  # BenchConfig checks it
        built = [prompts.token_ids(n, rng) for n in input_lens]
    else:
        built = prompts.texts(input_lens, rng) if prompts else word_prompts(input_lens, rng)
    return [
        BenchRequest(first_index + i, p.prompt, p.num_tokens, p.exact, n_out)
        for i, (p, n_out) in enumerate(zip(built, output_lens, strict=True))
    ]


def _jsonl_requests(
    path: Path,
    default_output_len: int,
    prompts: TokenizerPrompts | None,
    token_ids: bool,
    num: int,
    first_index: int,
) -> list[BenchRequest]:
    """One request per line, {"prompt": str | [int], "output_len": int?}; cycled if short."""
    lines = _jsonl_lines(path)
    requests = []
    for i in range(num):
        lineno, text = lines[i % len(lines)]
        where = f"{path}:{lineno}"
        try:
            row = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not JSON ({e})") from None
        prompt = row.get("prompt") if isinstance(row, dict) else None
        ids = isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)
        if not (isinstance(prompt, str) and prompt) and not ids:
            raise ValueError(f"{where}: needs a non-empty 'prompt' (text or token ids)")
        out = _output_len(row, default_output_len, where)
        if isinstance(prompt, list):  # (a chat request refuses it when its body is built)
            count, exact = len(prompt), True
        elif prompts is not None:
            count, exact = prompts.count([prompt])[0], True
            if token_ids:
                prompt = prompts.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            count, exact = len(prompt.split()) + 1, False  # the server's usage corrects it
        requests.append(BenchRequest(first_index + i, prompt, count, exact, out))
    return requests


def _jsonl_lines(path: Path) -> list[tuple[int, str]]:
    """The file's non-blank lines with their line numbers (errors name them)."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ValueError(f"--dataset-path {str(path)!r}: {reason}") from None
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not lines:
        raise ValueError(f"no requests in {str(path)!r}")
    return lines


def _output_len(row: dict[str, Any], default: int, where: str) -> int:
    """A line's output length: an integer >= 1 (a float only when it is a whole number; 3.9 is
    refused rather than cut to 3)."""
    field = next((f for f in ("output_len", "max_tokens") if f in row), None)
    if field is None:
        return default
    value = row[field]
    whole = isinstance(value, float) and math.isfinite(value) and value.is_integer()
    if (isinstance(value, int) and not isinstance(value, bool)) or whole:
        if value >= 1:
            return int(value)
    raise ValueError(f"{where}: {field} must be an integer >= 1, got {json.dumps(value)}")
