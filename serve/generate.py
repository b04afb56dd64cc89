"""POST /generate: the simple shape. `{"prompt", "max_tokens", "stream"}` in; out, either one JSON
object, or (stream) one JSON line per generated token:

    {"text": "Hel", "token_ids": [412], "finish_reason": null}
    ...
    {"text": "", "token_ids": [2], "finish_reason": "stop", "usage": {...}, "metrics": {...}}

`text` is the text that token released (empty while it may be the start of a stop string). A
client that falls behind gets the tokens waiting for it in one line. An error after the first line
is one line `{"error": {...}}`.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from nori_jax.core.outputs import RequestOutput
from serve import convert
from serve.context import get_context
from serve.protocol import GenerateRequest
from serve.responses import stage_metrics, usage
from serve.streaming import (
    EngineStreamingResponse,
    ndjson,
    stream_events,
)

router = APIRouter()


@router.post("/generate")
async def generate(body: GenerateRequest, request: Request) -> Response:
    ctx = get_context(request)
    prompt_ids = convert.encode(ctx, body.prompt)
    max_tokens = convert.max_new_tokens(
        ctx, len(prompt_ids), body.max_tokens, "max_tokens", "prompt"
    )
    params = convert.sampling_params(body, max_tokens)
    stream = await ctx.submit(prompt_ids, params, f"gen-{uuid.uuid4().hex}")
    if body.stream:
        return EngineStreamingResponse(
            stream_events(
                stream, _lines, encode_error=ndjson, retry_after_s=ctx.settings.retry_after_s
            ),
            stream,
            "application/x-ndjson",
        )
    out = await ctx.final_output(request, stream)
    return JSONResponse(
        {
            "text": out.text,
            "token_ids": out.token_ids,
            "finish_reason": out.finish_reason,
            "usage": usage(out),
            "metrics": stage_metrics(out),
        }
    )


def _lines(out: RequestOutput) -> Iterable[str]:
    if not out.new_token_ids and not out.finished:
        return
    line = {
        "text": out.new_text,
        "token_ids": out.new_token_ids,
        "finish_reason": out.finish_reason if out.finished else None,
    }
    if out.finished:
        line |= {"usage": usage(out), "metrics": stage_metrics(out)}
    yield ndjson(line)
