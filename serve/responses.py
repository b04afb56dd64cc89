"""Response pieces shared by the routes: usage, stage timings, logprobs, finish reasons."""

from __future__ import annotations

from typing import Any

from nori_jax.core.outputs import RequestOutput
from nori_jax.tokenizer import Tokenizer


def usage(outs: list[RequestOutput], n: int | None = None) -> dict[str, int]:
    """An answer's token counts: each prompt once (its `n` choices, consecutive in `outs`, share
    it; default: all of them), every choice's output."""
    p = sum(len(out.prompt_token_ids) for out in outs[:: n or len(outs)])
    c = sum(len(out.token_ids) for out in outs)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def stage_metrics(out: RequestOutput) -> dict[str, Any]:
    """The request's own timings in seconds (queue, prefill, decode, TTFT, E2E): the extension
    field `metrics` of a response."""
    return out.metrics._asdict()


def whole_answer(
    head: dict[str, Any],
    obj: str,
    choices: list[dict[str, Any]],
    outs: list[RequestOutput],
    n: int | None = None,
) -> dict[str, Any]:
    """A non-streamed OpenAI answer (`n`: choices per prompt, as `usage` takes it). `metrics` is
    the request's; with several choices each choice carries its own instead (each was a request
    of the engine's)."""
    answer = head | {"object": obj, "choices": choices, "usage": usage(outs, n)}
    if len(outs) == 1:
        answer["metrics"] = stage_metrics(outs[0])
    else:
        for choice, out in zip(choices, outs, strict=True):
            choice["metrics"] = stage_metrics(out)
    return answer


def token_strings(tok: Tokenizer | None, token_ids: list[int]) -> list[str]:
    if tok is None:
        return [f"<{t}>" for t in token_ids]
    return [tok.decode([t], skip_special_tokens=False) for t in token_ids]


TopLogprobs = list[list[tuple[int, float]]]  # per token: (token id, logprob), best first


def completion_logprobs(
    tok: Tokenizer | None,
    token_ids: list[int],
    logprobs: list[float],
    text_offset: int,
    top: TopLogprobs | None = None,
) -> dict[str, Any]:
    """OpenAI's legacy logprobs object. `top_logprobs` (with logprobs >= 1): per token, a
    mapping of the most likely tokens' strings to their logprobs, and the sampled token's
    (so up to logprobs + 1 entries, as OpenAI and vLLM answer); null with logprobs = 0. Tokens
    that decode to one string (byte pieces of a character, U+FFFD) share an entry, which holds
    the likeliest's logprob, or the sampled token's if it is one of them."""
    tokens = token_strings(tok, token_ids)
    offsets = []
    for t in tokens:
        offsets.append(text_offset)
        text_offset += len(t)
    top_maps = None
    if top is not None:
        top_maps = []
        for token, lp, pairs in zip(tokens, logprobs, top, strict=True):
            mapping: dict[str, float] = {}
            strings = token_strings(tok, [i for i, _ in pairs])
            for string, value in zip(strings, (v for _, v in pairs), strict=True):
                mapping.setdefault(string, value)  # tokens of one string: the likeliest's
            mapping[token] = lp  # the sampled token's own, as token_logprobs says
            top_maps.append(mapping)
    return {
        "tokens": tokens,
        "token_logprobs": logprobs,
        "top_logprobs": top_maps,
        "text_offset": offsets,
    }


def _chat_entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


def chat_logprobs(
    tok: Tokenizer | None,
    token_ids: list[int],
    logprobs: list[float],
    top: TopLogprobs | None = None,
) -> dict[str, Any]:
    """OpenAI's chat logprobs: per token its string, logprob and bytes, and `top_logprobs`, the
    `top_logprobs` most likely tokens (empty without them)."""
    tops = top if top is not None else [[] for _ in token_ids]
    return {
        "content": [
            _chat_entry(t, lp)
            | {
                "top_logprobs": [
                    _chat_entry(s, v)
                    for s, v in zip(
                        token_strings(tok, [i for i, _ in pairs]),
                        (v for _, v in pairs),
                        strict=True,
                    )
                ]
            }
            for t, lp, pairs in zip(token_strings(tok, token_ids), logprobs, tops, strict=True)
        ]
    }


def new_logprobs(out: RequestOutput) -> list[float]:
    """Logprobs of this output's new tokens."""
    return out.new_logprobs or []


def vllm_prompt_logprobs(
    tok: Tokenizer | None, out: RequestOutput, k: int
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: per prompt token (None for the first) a mapping of token ids (as
    strings) to {logprob, rank, decoded_token}: the prompt token's own, then its position's k
    likeliest (rank 1 to k)."""
    ids, values = out.prompt_token_ids, out.prompt_logprobs
    tops, ranks = out.prompt_top_logprobs, out.prompt_logprob_ranks
    if values is None or ranks is None:  # (the engine computes them for every such request)
        raise RuntimeError(f"request {out.request_id}: no prompt logprobs came back")
    entries: list[dict[str, dict[str, Any]] | None] = [None]
    for p in range(1, len(ids)):
        pairs = [(ids[p], values[p], ranks[p])]
        if k and tops is not None:
            pairs += [(t, v, r) for r, (t, v) in enumerate(tops[p][:k], start=1)]
        strings = token_strings(tok, [t for t, _, _ in pairs])
        entry: dict[str, dict[str, Any]] = {}
        for (t, v, r), string in zip(pairs, strings, strict=True):
            entry.setdefault(str(t), {"logprob": v, "rank": r, "decoded_token": string})
        entries.append(entry)
    return entries
