"""POST /v1/chat/completions: messages through the chat template, streamed as SSE or whole."""

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
from serve.errors import bad_request
from serve.protocol import ChatCompletionRequest
from serve.responses import chat_logprobs, new_logprobs, stage_metrics, usage
from serve.streaming import (
    SSE_DONE,
    EngineStreamingResponse,
    sse,
    stream_events,
)

router = APIRouter()


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    ctx = get_context(request)
    convert.check_model(ctx, body.model)
    convert.check_unsupported(body)
    if body.top_logprobs:
        raise bad_request(
            "top_logprobs is not supported (only the sampled token's logprob)", "top_logprobs"
        )
    prompt_ids = convert.chat_prompt(ctx, body)
    asked, param = body.max_completion_tokens, "max_completion_tokens"
    if asked is None:
        asked, param = body.max_tokens, "max_tokens"
    max_tokens = convert.max_new_tokens(ctx, len(prompt_ids), asked, param, "messages")
    params = convert.sampling_params(body, max_tokens, 0 if body.logprobs else None)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    stream = await ctx.submit(prompt_ids, params, request_id)
    fields = {"id": request_id, "created": int(time.time()), "model": ctx.settings.model_name}
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return EngineStreamingResponse(
            _events(ctx, fields, stream, include_usage, body.logprobs), stream, "text/event-stream"
        )
    out = await ctx.final_output(request, stream)
    logprobs = chat_logprobs(ctx.tokenizer, out.token_ids, out.logprobs) if body.logprobs else None
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": out.text},
        "logprobs": logprobs,
        "finish_reason": out.finish_reason,
    }
    return JSONResponse(
        fields
        | {
            "object": "chat.completion",
            "choices": [choice],
            "usage": usage(out),
            "metrics": stage_metrics(out),
        }
    )


def _events(
    ctx: ServeContext,
    fields: dict[str, Any],
    stream: RequestStream,
    include_usage: bool,
    want_logprobs: bool,
) -> AsyncIterator[str]:
    head = fields | {"object": "chat.completion.chunk"}
    extra = {"usage": None} if include_usage else {}
    final: list[RequestOutput] = []

    def chunk(delta: dict[str, Any], finish: str | None, logprobs: Any = None) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return head | {"choices": [choice]} | extra

    def events(out: RequestOutput) -> Iterable[str]:
        if not (out.new_text or out.finished or (want_logprobs and out.new_token_ids)):
            return  # text held back (it may start a stop string): nothing to say yet
        logprobs = None
        if want_logprobs:
            logprobs = chat_logprobs(ctx.tokenizer, out.new_token_ids, new_logprobs(out))
        if out.new_text or logprobs:
            yield sse(chunk({"content": out.new_text}, None, logprobs))
        if out.finished:
            final.append(out)
            yield sse(chunk({}, out.finish_reason) | {"metrics": stage_metrics(out)})

    def tail() -> Iterable[str]:
        if include_usage and final:
            yield sse(head | {"choices": [], "usage": usage(final[0])})
        yield SSE_DONE

    # The assistant's role comes first, before any token exists, as OpenAI sends it.
    role = sse(chunk({"role": "assistant", "content": ""}, None))
    return stream_events(
        stream, events, head=[role], tail=tail, retry_after_s=ctx.settings.retry_after_s
    )
