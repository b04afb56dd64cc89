"""The requests of a run: lognormal, fixed or JSONL prompts with their input and output lengths."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from nori_jax.bench.config import DatasetConfig, LognormalLengths
from nori_jax.bench.prompts import TokenizerPrompts, WordPrompts


@dataclasses.dataclass(frozen=True)
class BenchRequest:
    index: int
    prompt: str | list[int]  # completions prompt text or token ids, or the chat user message
    prompt_len: int  # the server's count when `prompt_len_exact`, else the client's estimate
    prompt_len_exact: bool
    output_len: int  # max_tokens


def sample_lengths(dist: LognormalLengths, n: int, rng: np.random.Generator) -> np.ndarray:
    """[n] int64 token counts: round(exp(N(mu, sigma))) clipped to the distribution's bounds."""
    raw = np.exp(rng.normal(dist.mu, dist.sigma, size=n))
    return np.clip(np.rint(raw), dist.min_len, dist.max_len).astype(np.int64)


def build_requests(
    cfg: DatasetConfig,
    prompts: TokenizerPrompts | WordPrompts,
    num: int,
    rng: np.random.Generator,
    first_index: int = 0,
    content_rng: np.random.Generator | None = None,
) -> list[BenchRequest]:
    """`num` requests; the rng alone decides lengths and tokens, so a seed fixes the workload.

    content_rng, when given, draws the prompts' tokens instead: the same lengths with other
    content (a sweep's later rates, so a prefix-caching server cannot reuse earlier prompts).
    """
    if cfg.kind == "jsonl":
        assert cfg.path is not None  # DatasetConfig checks it
        return _jsonl_requests(Path(cfg.path), cfg, prompts, num, first_index)
    if cfg.kind == "lognormal":
        input_lens = sample_lengths(cfg.input_lengths, num, rng)
        output_lens = sample_lengths(cfg.output_lengths, num, rng)
    else:
        input_lens = np.full(num, cfg.input_len, dtype=np.int64)
        output_lens = np.full(num, cfg.output_len, dtype=np.int64)
    rng = content_rng or rng
    if cfg.prompt_format == "token-ids":
        assert isinstance(prompts, TokenizerPrompts)  # BenchConfig checks it
        built = [prompts.token_ids(n, rng) for n in input_lens.tolist()]
    else:
        built = prompts.texts(input_lens.tolist(), rng)
    return [
        BenchRequest(first_index + i, p.prompt, p.num_tokens, p.exact, n_out)
        for i, (p, n_out) in enumerate(zip(built, output_lens.tolist(), strict=True))
    ]


def _jsonl_requests(
    path: Path,
    cfg: DatasetConfig,
    prompts: TokenizerPrompts | WordPrompts,
    num: int,
    first_index: int,
) -> list[BenchRequest]:
    """One request per line, {"prompt": str | [int], "output_len": int?}; cycled if short."""
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    if not lines:
        raise ValueError(f"no requests in {str(path)!r}")
    requests = []
    for i in range(num):
        lineno = i % len(lines) + 1
        row = _parse_line(lines[lineno - 1], path, lineno)
        prompt = row["prompt"]
        out = int(row.get("output_len", row.get("max_tokens", cfg.output_len)))
        if out < 1:
            raise ValueError(f"{path}:{lineno}: output_len must be >= 1, got {out}")
        exact_len, exact = _count_jsonl_prompt(prompt, cfg, prompts)
        if cfg.prompt_format == "token-ids" and isinstance(prompt, str):
            assert isinstance(prompts, TokenizerPrompts)
            prompt = prompts.tokenizer.encode(prompt, add_special_tokens=True)
        requests.append(BenchRequest(first_index + i, prompt, exact_len, exact, out))
    return requests


def _parse_line(line: str, path: Path, lineno: int) -> dict[str, Any]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{lineno}: not JSON ({e})") from None
    prompt = row.get("prompt") if isinstance(row, dict) else None
    ok_ids = isinstance(prompt, list) and all(isinstance(t, int) for t in prompt) and prompt
    if not (isinstance(prompt, str) and prompt) and not ok_ids:
        raise ValueError(f"{path}:{lineno}: needs a non-empty 'prompt' (text or token ids)")
    return row


def _count_jsonl_prompt(
    prompt: str | list[int], cfg: DatasetConfig, prompts: TokenizerPrompts | WordPrompts
) -> tuple[int, bool]:
    if isinstance(prompt, list):
        if prompts.endpoint == "chat":
            raise ValueError("token-id prompts cannot be sent to /v1/chat/completions")
        return len(prompt), True
    if isinstance(prompts, TokenizerPrompts):
        return prompts.count(prompt), True
    return len(prompt.split()) + 1, False  # the word estimate; the server's usage corrects it
