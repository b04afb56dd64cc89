"""POST /v1/completions: one prompt (text or token ids), streamed as SSE or answered whole."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Iterable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from nori_jax.async_engine import RequestStream
from nori_jax.core.outputs import RequestOutput
from serve import convert
from serve.context import ServeContext, get_context
from serve.protocol import CompletionRequest
from serve.responses import completion_logprobs, new_logprobs, stage_metrics, usage
from serve.streaming import (
    SSE_DONE,
    EngineStreamingResponse,
    sse,
    stream_events,
)

router = APIRouter()


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    ctx = get_context(request)
    convert.check_model(ctx, body.model)
    convert.check_unsupported(body)
    prompt_ids = convert.encode(ctx, convert.completion_prompt(body))
    max_tokens = convert.max_new_tokens(
        ctx, len(prompt_ids), body.max_tokens, "max_tokens", "prompt"
    )
    params = convert.sampling_params(body, max_tokens, body.logprobs)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    stream = await ctx.submit(prompt_ids, params, request_id)
    head = _Head(request_id, int(time.time()), ctx.settings.model_name)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return EngineStreamingResponse(
            _events(ctx, head, stream, include_usage, body.logprobs is not None),
            stream,
            "text/event-stream",
        )
    out = await ctx.final_output(request, stream)
    logprobs = None
    if out.logprobs is not None:
        logprobs = completion_logprobs(ctx.tokenizer, out.token_ids, out.logprobs, 0)
    return JSONResponse(
        head.body(
            choices=[
                {
                    "index": 0,
                    "text": out.text,
                    "logprobs": logprobs,
                    "finish_reason": out.finish_reason,
                }
            ],
            usage=usage(out),
            metrics=stage_metrics(out),
        )
    )


class _Head:
    """The fields every completion object and chunk repeats."""

    def __init__(self, request_id: str, created: int, model: str):
        self.fields = {
            "id": request_id,
            "object": "text_completion",
            "created": created,
            "model": model,
        }

    def body(self, **rest: Any) -> dict[str, Any]:
        return self.fields | rest


def _events(
    ctx: ServeContext, head: _Head, stream: RequestStream, include_usage: bool, want_logprobs: bool
) -> AsyncIterator[str]:
    extra = {"usage": None} if include_usage else {}
    text_offset = 0
    final: list[RequestOutput] = []

    def events(out: RequestOutput) -> Iterable[str]:
        nonlocal text_offset
        if not (out.new_text or out.finished or (want_logprobs and out.new_token_ids)):
            return  # text held back (it may start a stop string): nothing to say yet
        logprobs = None
        if want_logprobs:
            logprobs = completion_logprobs(
                ctx.tokenizer, out.new_token_ids, new_logprobs(out), text_offset
            )
        text_offset += len(out.new_text)
        choice = {
            "index": 0,
            "text": out.new_text,
            "logprobs": logprobs,
            "finish_reason": out.finish_reason if out.finished else None,
        }
        chunk = head.body(choices=[choice], **extra)
        if out.finished:
            final.append(out)
            chunk["metrics"] = stage_metrics(out)
        yield sse(chunk)

    def tail() -> Iterable[str]:
        if include_usage and final:
            yield sse(head.body(choices=[], usage=usage(final[0])))
        yield SSE_DONE

    return stream_events(stream, events, tail=tail, retry_after_s=ctx.settings.retry_after_s)
