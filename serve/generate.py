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

from collections.abc import AsyncIterator, Iterable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from nori_jax.core.outputs import RequestOutput
from serve import generation
from serve.choices import Choices
from serve.context import get_context
from serve.protocol import GenerateRequest
from serve.responses import stage_metrics, usage
from serve.streaming import ndjson, stream_events

router = APIRouter()


@router.post("/generate")
async def generate(body: GenerateRequest, request: Request) -> Response:
    return await generation.handle(Generate(get_context(request), body), request)


class Generate(generation.GenerationRoute):
    id_prefix = "gen"
    media_type = "application/x-ndjson"
    body: GenerateRequest

    def prompt_ids(self) -> list[int]:
        return self.ctx.engine.tokenize(self.body.prompt)

    def answer(self, head: dict[str, Any], outs: list[RequestOutput]) -> dict[str, Any]:
        (out,) = outs  # one choice: /generate has no `n`
        return {
            "text": out.text,
            "token_ids": out.token_ids,
            "finish_reason": out.finish_reason,
            "usage": usage(outs),
            "metrics": stage_metrics(out),
        }

    def events(self, head: dict[str, Any], choices: Choices) -> AsyncIterator[bytes]:
        return stream_events(
            choices, _lines, encode_error=ndjson, retry_after_s=self.ctx.settings.retry_after_s
        )


def _lines(index: int, out: RequestOutput) -> Iterable[bytes]:
    if not out.new_token_ids and not out.finished:
        return
    line = {
        "text": out.new_text,
        "token_ids": out.new_token_ids,
        "finish_reason": out.finish_reason if out.finished else None,
    }
    if out.finished:
        line |= {"usage": usage([out]), "metrics": stage_metrics(out)}
    yield ndjson(line)
