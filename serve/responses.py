"""Response pieces shared by the routes: usage, stage timings, logprobs, finish reasons."""

from __future__ import annotations

from typing import Any

from nori_jax.core.outputs import RequestOutput
from nori_jax.tokenizer import Tokenizer


def usage(outs: list[RequestOutput]) -> dict[str, int]:
    """An answer's token counts: the prompt once (its choices share it), every choice's output."""
    p, c = len(outs[0].prompt_token_ids), sum(len(out.token_ids) for out in outs)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def stage_metrics(out: RequestOutput) -> dict[str, Any]:
    """The request's own timings in seconds (queue, prefill, decode, TTFT, E2E): the extension
    field `metrics` of a response."""
    return out.metrics._asdict()


def whole_answer(
    head: dict[str, Any], obj: str, choices: list[dict[str, Any]], outs: list[RequestOutput]
) -> dict[str, Any]:
    """A non-streamed OpenAI answer. `metrics` is the request's; with several choices each
    choice carries its own instead (each was a request of the engine's)."""
    answer = head | {"object": obj, "choices": choices, "usage": usage(outs)}
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


def completion_logprobs(
    tok: Tokenizer | None, token_ids: list[int], logprobs: list[float], text_offset: int
) -> dict[str, Any]:
    """OpenAI's legacy logprobs object; only the sampled token's logprob (top_logprobs: null)."""
    tokens = token_strings(tok, token_ids)
    offsets = []
    for t in tokens:
        offsets.append(text_offset)
        text_offset += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": logprobs,
        "top_logprobs": None,
        "text_offset": offsets,
    }


def chat_logprobs(
    tok: Tokenizer | None, token_ids: list[int], logprobs: list[float]
) -> dict[str, Any]:
    return {
        "content": [
            {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
            for t, lp in zip(token_strings(tok, token_ids), logprobs, strict=True)
        ]
    }


def new_logprobs(out: RequestOutput) -> list[float]:
    """Logprobs of this output's new tokens."""
    return out.new_logprobs or []
