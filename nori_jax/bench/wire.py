"""The OpenAI wire format as the load generator uses it: request bodies and streamed chunks.

Only chunks that carry generated text count as tokens for TTFT and ITL. Chat servers (vLLM
among them) open the stream with an empty `{"role": "assistant"}` delta before any token exists;
timing that chunk would report a TTFT of a few milliseconds whatever the prefill cost.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from nori_jax.bench.config import EndpointKind


def request_body(
    endpoint: EndpointKind,
    model: str,
    prompt: str | list[int],
    max_tokens: int,
    *,
    ignore_eos: bool,
    temperature: float,
    max_tokens_field: str = "max_tokens",
    extra_body: Mapping[str, Any] | None = None,
) -> bytes:
    """A streaming request with usage in the last chunk; serialised once, before the run."""
    body: dict[str, Any] = {"model": model}
    if endpoint == "chat":
        if not isinstance(prompt, str):
            raise ValueError("chat requests take a text prompt, got token ids")
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    body[max_tokens_field] = max_tokens
    body["temperature"] = temperature
    body["stream"] = True
    body["stream_options"] = {"include_usage": True}
    if ignore_eos:
        body["ignore_eos"] = True  # vLLM/SGLang extension: generate exactly max_tokens
    if extra_body:
        body.update(extra_body)
    return json.dumps(body, separators=(",", ":")).encode()


@dataclasses.dataclass(frozen=True)
class Chunk:
    """What one `data:` event says. `done` is the `[DONE]` sentinel."""

    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    error: str | None = None
    done: bool = False


DONE = Chunk(done=True)


def parse_data(payload: bytes, endpoint: EndpointKind) -> Chunk:
    """Parse the payload of one SSE `data:` line; malformed JSON becomes an error chunk."""
    if payload == b"[DONE]":
        return DONE
    try:
        obj = json.loads(payload.decode())  # str: json skips its encoding sniffing (~25% faster)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return Chunk(error=f"malformed stream event: {payload[:200]!r}")
    if not isinstance(obj, dict):
        return Chunk(error=f"unexpected stream event: {payload[:200]!r}")
    if "error" in obj and not obj.get("choices"):
        return Chunk(error=f"server error in stream: {_error_message(obj)}")
    text, finish = "", None
    choices = obj.get("choices")
    if choices and isinstance(choices[0], dict):
        choice = choices[0]
        finish = choice.get("finish_reason")
        if endpoint == "chat":
            delta = choice.get("delta") or {}
            # reasoning models stream their thinking first; those tokens are output tokens too
            text = delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
        else:
            text = choice.get("text")
    usage = obj.get("usage") or {}
    return Chunk(
        text=text or "",
        finish_reason=finish,
        completion_tokens=usage.get("completion_tokens"),
        prompt_tokens=usage.get("prompt_tokens"),
    )


def error_from_body(status: int, body: bytes) -> str:
    """'HTTP 503: <message>' from an error response, whatever shape its JSON has."""
    message = body[:300].decode(errors="replace").strip()
    try:
        message = _error_message(json.loads(body))
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError, AttributeError):
        pass
    return f"HTTP {status}: {message}" if message else f"HTTP {status}"


def _error_message(obj: Any) -> str:
    if isinstance(obj, dict):
        err = obj.get("error", obj.get("detail", obj.get("message", obj)))
        if isinstance(err, dict):
            err = err.get("message", err)
        return str(err)[:300]
    return str(obj)[:300]
