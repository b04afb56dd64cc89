"""POST /v1/chat/completions: messages through the chat template, `n` choices of the answer,
streamed as SSE or whole."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from nori_jax.core.outputs import RequestOutput
from serve import convert, generation
from serve.choices import Choices
from serve.context import get_context
from serve.errors import bad_request
from serve.protocol import ChatCompletionRequest
from serve.responses import (
    chat_logprobs,
    new_logprobs,
    stage_metrics,
    usage,
    vllm_prompt_logprobs,
    whole_answer,
)
from serve.streaming import SSE_DONE, sse, stream_events

router = APIRouter()


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    return await generation.handle(ChatCompletion(get_context(request), body), request)


class ChatCompletion(generation.GenerationRoute):
    id_prefix = "chatcmpl"
    prompt_param = "messages"
    top_logprobs_param = "top_logprobs"
    body: ChatCompletionRequest

    def check(self) -> None:
        convert.check_unsupported(self.body)
        convert.check_chat(self.ctx, self.body)

    def prompt_ids(self) -> list[int]:
        return convert.chat_prompt(self.ctx, self.body)

    def max_tokens(self) -> tuple[int | None, str]:
        if self.body.max_completion_tokens is not None:
            return self.body.max_completion_tokens, "max_completion_tokens"
        return self.body.max_tokens, "max_tokens"

    def logprobs(self) -> int | None:
        if self.body.top_logprobs is not None and not self.body.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
        return (self.body.top_logprobs or 0) if self.body.logprobs else None

    def prompt_logprobs(self) -> int | None:
        return self.body.prompt_logprobs  # vLLM's field

    def answer(self, head: dict[str, Any], outs: list[RequestOutput]) -> dict[str, Any]:
        choices = []
        for index, out in enumerate(outs):
            logprobs = None
            if self.body.logprobs:
                logprobs = chat_logprobs(
                    self.ctx.tokenizer, out.token_ids, out.logprobs, out.top_logprobs
                )
            choices.append(
                {
                    "index": index,
                    "message": {"role": "assistant", "content": out.text},
                    "logprobs": logprobs,
                    "finish_reason": out.finish_reason,
                }
            )
        answer = whole_answer(head, "chat.completion", choices, outs)
        if self.body.prompt_logprobs is not None:  # one prompt: the answer's, as vLLM's
            answer["prompt_logprobs"] = vllm_prompt_logprobs(
                self.ctx.tokenizer, outs[0], self.body.prompt_logprobs
            )
        return answer

    def events(self, head: dict[str, Any], choices: Choices) -> AsyncIterator[bytes]:
        ctx, body = self.ctx, self.body
        head = head | {"object": "chat.completion.chunk"}
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        want_logprobs = bool(body.logprobs)
        extra = {"usage": None} if include_usage else {}
        final: list[RequestOutput] = []

        def chunk(index: int, delta: dict, finish: str | None, logprobs: Any = None) -> dict:
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            return head | {"choices": [choice]} | extra

        def events(index: int, out: RequestOutput) -> Iterable[bytes]:
            if not (out.new_text or out.finished or (want_logprobs and out.new_token_ids)):
                return  # text held back (it may start a stop string): nothing to say yet
            logprobs = None
            if want_logprobs:
                logprobs = chat_logprobs(
                    ctx.tokenizer, out.new_token_ids, new_logprobs(out), out.new_top_logprobs
                )
            if out.new_text or logprobs:
                yield sse(chunk(index, {"content": out.new_text}, None, logprobs))
            if out.finished:
                final.append(out)
                yield sse(chunk(index, {}, out.finish_reason) | {"metrics": stage_metrics(out)})

        def tail() -> Iterable[bytes]:
            if include_usage and len(final) == len(choices):
                yield sse(head | {"choices": [], "usage": usage(final)})
            yield SSE_DONE

        # Each choice's role comes first, before any token exists, as OpenAI sends it.
        roles = [
            sse(chunk(i, {"role": "assistant", "content": ""}, None)) for i in range(len(choices))
        ]
        return stream_events(
            choices, events, head=roles, tail=tail, retry_after_s=ctx.settings.retry_after_s
        )
