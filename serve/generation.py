"""The skeleton the three generation routes share (/v1/completions, /v1/chat/completions,
/generate):

    check the body -> prompt token ids (off the event loop) -> generation budget ->
    SamplingParams -> hand its `n` choices to the engine -> a stream of events, or the whole
    answer

A route says only what differs (a `GenerationRoute`): how its body becomes a prompt, which field
names the prompt and the budget, and the shape of its answer and of its stream. Every error on
the way is an ApiError whose `param` names the route's own field.
"""

from __future__ import annotations

import abc
import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from nori_jax.core.outputs import RequestOutput
from nori_jax.sampling_params import ParameterError, SamplingParams
from serve import convert
from serve.choices import Choices
from serve.context import ServeContext
from serve.errors import bad_request, parameter_error
from serve.streaming import EngineStreamingResponse


class GenerationRoute(abc.ABC):
    id_prefix: str  # of the request id: "cmpl", "chatcmpl", "gen"
    media_type: str = "text/event-stream"  # of a streamed answer
    prompt_param: str = "prompt"  # the field a prompt error names
    top_logprobs_param: str = "logprobs"  # the field that asks for top logprobs

    def __init__(self, ctx: ServeContext, body: Any):
        self.ctx, self.body = ctx, body

    def check(self) -> None:  # noqa: B027 - an optional hook
        """Refuse what the body asks for and this route cannot do (an ApiError)."""

    @abc.abstractmethod
    def prompt_ids(self) -> list[int]:
        """The prompt's token ids (blocking: tokenization and templating run in a worker thread)."""

    def max_tokens(self) -> tuple[int | None, str]:
        """The budget asked for (None: all the room the model length leaves) and its field."""
        return self.body.max_tokens, "max_tokens"

    def logprobs(self) -> int | None:
        return None

    def prompt_logprobs(self) -> int | None:
        """The prompt's logprobs asked for (completions: echo with logprobs)."""
        return None

    @property
    def n(self) -> int:
        """Choices asked for: independent samples of the same prompt."""
        return getattr(self.body, "n", None) or 1

    @property
    def num_choices(self) -> int:
        """Choices of the whole answer: n of each prompt (completions takes a batch)."""
        return self.n

    @abc.abstractmethod
    def answer(self, head: dict[str, Any], outs: list[RequestOutput]) -> dict[str, Any]:
        """The whole answer's JSON body, from each choice's final output (in index order)."""

    @abc.abstractmethod
    def events(self, head: dict[str, Any], choices: Choices) -> AsyncIterator[bytes]:
        """The streamed answer's body."""

    def sampling_params(self, prompt_len: int) -> SamplingParams:
        asked, param = self.max_tokens()
        budget = convert.max_new_tokens(self.ctx, prompt_len, asked, param, self.prompt_param)
        logprobs, prompt_logprobs = self.logprobs(), self.prompt_logprobs()
        # Every logprob entry of the answer is held until it is sent: bounded where top logprobs
        # are asked for, and for the prompt's (new with echo: no answer accepted before is refused)
        if prompt_logprobs is not None:
            budget_param = f"(prompt + {param})"
            k = max(logprobs or 0, prompt_logprobs)
            field = self.top_logprobs_param if logprobs == k else "prompt_logprobs"
            self._check_logprob_entries(k, prompt_len + budget, budget_param, field)
        elif logprobs:
            self._check_logprob_entries(logprobs, budget, param)
        return convert.sampling_params(self.body, budget, logprobs, prompt_logprobs)

    def _check_logprob_entries(
        self, k: int, budget: int, budget_param: str, field: str | None = None
    ) -> None:
        """choices x max_tokens x (k + 1) logprobs (each token's and its k likeliest) at most the
        server's bound: a whole answer holds them all, about 0.5 KB each. (The sampled tokens'
        logprobs alone, k = 0 without the prompt's, stay unbounded, as they were before top
        logprobs.)"""
        choices, field = self.num_choices, field or self.top_logprobs_param
        entries, most = choices * budget * (k + 1), self.ctx.settings.max_logprob_entries
        if entries > most:
            raise bad_request(
                f"choices x {budget_param} x ({field} + 1) = {choices} x {budget} x {k + 1} = "
                f"{entries} logprob entries; this server answers at most {most} per request "
                "(--max-logprob-entries)",
                field,
            )

    def prepare_all(self) -> list[tuple[list[int], SamplingParams]]:
        """`prepare` of each of the request's prompts (one, but for a completions batch)."""
        return [self.prepare()]

    def prepare(self) -> tuple[list[int], SamplingParams]:
        """Everything before the engine: the checks, the prompt's token ids, the budget and the
        sampling settings; an ApiError for bad input. Blocking (it tokenizes): the server runs
        it in a worker thread, `nori-jax run-batch` in grain's reader threads."""
        convert.check_model(self.ctx, getattr(self.body, "model", None))
        self.check()
        try:
            prompt_ids = self.prompt_ids()
            return prompt_ids, self.sampling_params(len(prompt_ids))
        except ParameterError as e:
            raise parameter_error(e, self.prompt_param) from None

    @classmethod
    def new_request_id(cls) -> str:
        return f"{cls.id_prefix}-{uuid.uuid4().hex}"

    def head(self, request_id: str) -> dict[str, Any]:
        """The fields every answer (and every streamed chunk) starts with."""
        return {
            "id": request_id,
            "created": int(time.time()),
            "model": self.ctx.settings.model_name,
        }


async def handle(route: GenerationRoute, request: Request) -> Response:
    ctx, body = route.ctx, route.body
    prompts = await asyncio.to_thread(route.prepare_all)
    request_id = route.new_request_id()
    priority = getattr(body, "priority", None) or 0
    choices = await ctx.submit(prompts, request_id, route.prompt_param, route.n, priority)
    head = route.head(request_id)
    if body.stream:
        return EngineStreamingResponse(route.events(head, choices), choices, route.media_type)
    outs = await ctx.final_outputs(request, choices)
    return JSONResponse(route.answer(head, outs))
