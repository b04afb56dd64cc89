"""An input line -> the request the server would hand its engine, or the line's error record.

The body goes through the server's own pydantic models and route (`GenerationRoute.prepare`:
the checks, the prompt's token ids, the budget, SamplingParams), so a batch line is accepted,
refused and answered exactly as the same request over HTTP. This runs in grain's reader threads
(it tokenizes), ahead of the engine.
"""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING, Any, cast

import pydantic

from nori_jax.async_engine import request_failed
from nori_jax.core.outputs import RequestOutput
from nori_jax.engine_client import EngineClient
from nori_jax.jsonl_source import JsonlLine
from nori_jax.prompts import lone_surrogate
from nori_jax.sampling_params import ParameterError, SamplingParams
from serve.batch.format import BatchLine, line_error_record, response_record
from serve.chat import ChatCompletion
from serve.completions import Completion
from serve.context import ServeContext
from serve.errors import (
    ApiError,
    api_error_from,
    bad_request,
    parameter_error,
    validation_error,
)
from serve.generation import GenerationRoute
from serve.protocol import ChatCompletionRequest, CompletionRequest
from serve.settings import ServerSettings

if TYPE_CHECKING:
    from nori_jax.engine import LLMEngine

ROUTES: dict[str, tuple[type[pydantic.BaseModel], type[GenerationRoute]]] = {
    "/v1/completions": (CompletionRequest, Completion),
    "/v1/chat/completions": (ChatCompletionRequest, ChatCompletion),
}


@dataclasses.dataclass
class Prepared:
    """A valid request: what goes to the engine, and the route that will write its answer."""

    custom_id: str
    route: GenerationRoute
    prompt_ids: list[int]
    params: SamplingParams
    priority: int = 0  # the body's (vLLM's extension field)


@dataclasses.dataclass
class Refused:
    """A line answered without the engine: its output record is ready."""

    custom_id: str | None
    record: dict[str, Any]


class PromptEncoder:
    """The part of an engine client the routes use before a request exists (`tokenize`, the
    tokenizer, the model length), over an LLMEngine in this process."""

    def __init__(self, engine: LLMEngine):
        self._engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return self._engine.tokenize(prompt)[0]


def batch_context(engine: LLMEngine, settings: ServerSettings) -> ServeContext:
    """The routes' context over an in-process engine: it prepares and answers requests; it does
    not submit them (the batch runner hands them to the engine itself)."""
    return ServeContext.build(cast(EngineClient, PromptEncoder(engine)), settings)


def read_line(ctx: ServeContext, line: JsonlLine) -> Prepared | Refused:
    where = f"line {line.index + 1}"
    if line.data is None:
        return Refused(
            None,
            line_error_record(
                None,
                "line_too_long",
                f"{where}: {line.size} bytes, more than the limit of "
                f"{ctx.settings.max_body_bytes} bytes (--max-line-bytes)",
            ),
        )
    try:
        obj = json.loads(line.data)
    except ValueError as e:  # not UTF-8 or not JSON
        return Refused(None, line_error_record(None, "invalid_json", f"{where}: {e}"))
    except RecursionError:  # nested deeper than the parser's recursion (a refusal, not a crash)
        message = f"{where}: the JSON is nested too deeply to parse"
        return Refused(None, line_error_record(None, "invalid_json", message))
    if not isinstance(obj, dict):
        message = f"{where}: a request must be a JSON object, got {type(obj).__name__}"
        return Refused(None, line_error_record(None, "invalid_batch_line", message))
    custom_id = obj.get("custom_id")
    # (one the output cannot hold, a lone surrogate, is not echoed: the line number says which)
    if not isinstance(custom_id, str) or lone_surrogate(custom_id) is not None:
        custom_id = None
    try:
        envelope = BatchLine.model_validate(obj)
    except pydantic.ValidationError as e:
        message = validation_error(e.errors()).message
        return Refused(
            custom_id, line_error_record(custom_id, "invalid_batch_line", f"{where}: {message}")
        )
    model, route_class = ROUTES[envelope.url]
    try:
        try:
            body = model.model_validate(envelope.body)
        except pydantic.ValidationError as e:
            raise validation_error(e.errors()) from None
        route = route_class(ctx, body)
        if body.stream:
            raise bad_request("stream is not supported in a batch job", "stream")
        prompt_ids, params = route.prepare()
    except Exception as e:  # noqa: BLE001 - whatever the server would answer, this line answers
        error = api_error_from(e, ctx.settings.retry_after_s)
        record = error_record(envelope.custom_id, route_class.new_request_id(), error)
        return Refused(envelope.custom_id, record)
    return Prepared(envelope.custom_id, route, prompt_ids, params, body.priority or 0)


def answer_record(
    prepared: Prepared,
    request_id: str,
    head: dict[str, Any],
    results: list[RequestOutput | ValueError],
) -> dict[str, Any]:
    """The output record of a request the engine took, from its `n` choices' results in index
    order: the server's answer; or, for the first choice that failed, its 500 (the engine failed
    it alone) or 400 (the engine refused its prompt or settings)."""
    for result in results:
        if isinstance(result, ValueError):
            error = api_error_from(result)
            if isinstance(result, ParameterError):
                error = parameter_error(result, prepared.route.prompt_param)
            return error_record(prepared.custom_id, request_id, error)
        if result.finish_reason == "error":
            error = api_error_from(request_failed(result))
            return error_record(prepared.custom_id, request_id, error)
    answer = prepared.route.answer(head, cast(list[RequestOutput], results))
    return response_record(prepared.custom_id, request_id, 200, answer)


def error_record(custom_id: str, request_id: str, error: ApiError) -> dict[str, Any]:
    return response_record(custom_id, request_id, error.status, error.body())
