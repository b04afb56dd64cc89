"""What every route needs: the engine, the settings, the tokenizer with its chat template, and the
two calls that hand a request to the engine and wait for it."""

from __future__ import annotations

import asyncio
import dataclasses
import time

from fastapi import Request

from nori_jax.async_engine import RequestStream
from nori_jax.core.outputs import RequestOutput
from nori_jax.engine_client import EngineClient
from nori_jax.sampling_params import ParameterError, SamplingParams, sample_choices
from nori_jax.tokenizer import Tokenizer
from serve.choices import Choices, choice_request_ids
from serve.errors import api_error_from, parameter_error
from serve.settings import ServerSettings
from serve.streaming import result_unless_disconnected


@dataclasses.dataclass
class ServeContext:
    engine: EngineClient
    settings: ServerSettings
    tokenizer: Tokenizer | None  # the engine's, with settings.chat_template applied
    max_model_len: int
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    @classmethod
    def build(cls, engine: EngineClient, settings: ServerSettings) -> ServeContext:
        tok = engine.tokenizer
        if tok is not None and settings.chat_template is not None:
            # A copy: the engine's own tokenizer stays as loaded.
            tok = dataclasses.replace(tok, chat_template=settings.chat_template)
        return cls(engine, settings, tok, engine.max_model_len)

    async def submit(
        self,
        prompts: list[tuple[list[int], SamplingParams]],
        request_id: str,
        prompt_param: str = "prompt",
        n: int = 1,
        priority: int = 0,
    ) -> Choices:
        """Hand a request's choices to the engine, `n` of each of its prompts (token ids and
        settings; choice i * n + j is prompt i's j-th); a refusal (400, 429, 503, ...) becomes
        the HTTP error, a prompt's fault named as `prompt_param`, and withdraws the choices
        handed over.

        The choices go out together, each sent before any acceptance is awaited: one by one, a
        request of 256 choices waited for a round trip through the core's step loop per choice
        (148 of 256 were queued after 0.5 s in a review), and later requests slipped in
        between its choices."""
        adds = [
            self.engine.add_request(
                prompt_ids, p, rid, self.settings.request_timeout_s, priority=priority
            )
            for i, (prompt_ids, params) in enumerate(prompts)
            for p, rid in zip(
                sample_choices(params, n),
                choice_request_ids(request_id, n, first=i * n),
                strict=True,
            )
        ]
        if len(adds) == 1:  # most requests: no task of their own (a cancelled add withdraws)
            try:
                results = [await adds[0]]
            except Exception as e:  # noqa: BLE001 - mapped to its HTTP error below
                results = [e]
        else:
            results = await self._add_together(adds)
        streams = [r for r in results if isinstance(r, RequestStream)]
        failure = next((r for r in results if isinstance(r, BaseException)), None)
        if failure is None:
            return Choices(streams)
        for stream in streams:
            stream.abort()
        if isinstance(failure, ParameterError):
            raise parameter_error(failure, prompt_param) from None
        if isinstance(failure, Exception):
            raise api_error_from(failure, self.settings.retry_after_s) from None
        raise failure

    @staticmethod
    async def _add_together(adds: list) -> list:
        """Run the adds at once (each sends, then awaits its acceptance): their streams or
        exceptions, in order. If cancelled (the client left), every choice is withdrawn."""
        tasks = [asyncio.ensure_future(add) for add in adds]
        try:
            await asyncio.wait(tasks)
        except BaseException:
            for task in tasks:
                task.cancel()  # one still waiting aborts its own request
            await asyncio.wait(tasks)
            for task in tasks:
                if not task.cancelled() and task.exception() is None:
                    task.result().abort()
            raise
        return [t.exception() or t.result() for t in tasks]

    async def final_outputs(self, request: Request, choices: Choices) -> list[RequestOutput]:
        """Wait for every choice's whole answer (all aborted if the client leaves); failures
        become HTTP errors."""
        try:
            return await result_unless_disconnected(request, choices)
        except Exception as e:
            raise api_error_from(e, self.settings.retry_after_s) from None


def get_context(request: Request) -> ServeContext:
    return request.app.state.ctx
