"""/openapi.json as the server really answers: the error object on every status a route can give
(400, never FastAPI's 422), the streaming media types, the generation routes' JSON bodies."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class StageMetrics(BaseModel):
    """The `metrics` extension field: the request's stage timings in seconds."""

    queue_time: float | None
    prefill_time: float | None
    decode_time: float | None
    time_to_first_token: float | None
    e2e_latency: float | None
    num_preemptions: int
    num_cached_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None  # per token, with logprobs >= 1
    text_offset: list[int]


class PromptLogprob(BaseModel):
    """vLLM's: a token's logprob, its rank at its position, and its text."""

    logprob: float
    rank: int | None
    decoded_token: str | None


# vLLM's prompt_logprobs: per prompt token (null for the first), token ids (as strings) -> entries
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    metrics: StageMetrics | None = None  # with n > 1: each choice's own (one request each)
    prompt_logprobs: PromptLogprobs | None = None  # asked for with prompt_logprobs


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    metrics: StageMetrics | None = None  # the request's, with n = 1 (else per choice)


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    metrics: StageMetrics | None = None  # with n > 1: each choice's own (one request each)


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    metrics: StageMetrics | None = None  # the request's, with n = 1 (else per choice)
    prompt_logprobs: PromptLogprobs | None = None  # asked for with prompt_logprobs


class GenerateResponse(BaseModel):
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage
    metrics: StageMetrics


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: None


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfo(BaseModel):
    tokenizer_class: str
    bos_token: str | None
    eos_token: str | None
    unk_token: str | None
    pad_token: str | None
    bos_token_id: int | None
    eos_token_ids: list[int]
    model_max_length: int
    vocab_size: int
    chat_template: str | None


class Health(BaseModel):
    status: Literal["ok", "unhealthy"]
    reason: str | None = None


class WeightState(BaseModel):
    is_sleeping: bool


_ANSWERS = {  # path -> the model of its 200 JSON body
    "/v1/completions": CompletionResponse,
    "/v1/chat/completions": ChatCompletionResponse,
    "/generate": GenerateResponse,
    "/tokenize": TokenizeResponse,
    "/detokenize": DetokenizeResponse,
    "/tokenizer_info": TokenizerInfo,
    "/v1/models": ModelList,
    "/health": Health,
} | {path: WeightState for path in ("/update_weights", "/sleep", "/wake_up", "/is_sleeping")}


_STATUS = {
    "400": "invalid request: bad JSON, a field of the wrong type or out of range, an "
    "unsupported field, a prompt that does not fit (param names the field)",
    "401": "missing or wrong API key (when the server has one)",
    "404": "the model named is not served",
    "408": "the request body did not arrive in time",
    "409": "requests are queued or running: a weight operation waits for an idle engine",
    "413": "the request body is larger than the server takes",
    "429": "the waiting queue is full (see Retry-After)",
    "500": "the engine died while the request was in flight, or failed this request",
    "503": "the engine is not serving: shutting down, restarting or asleep (see Retry-After)",
    "504": "the request ran past the server's request timeout",
}
_TOKENIZING = ("/tokenize", "/detokenize", "/tokenizer_info")  # no engine: no 429, 5xx
# One server-sent event, as OpenAPI 3.2 describes an event stream's items and as schemathesis
# reads an SSE media type's schema before 3.2: its fields, `data` a chunk's JSON (or [DONE]).
_SSE_EVENT = {
    "type": "object",
    "properties": {
        "data": {"type": "string"},
        "event": {"type": "string"},
        "id": {"type": "string"},
        "retry": {"type": "integer"},
    },
    "required": ["data"],
}
_TEXT = {"type": "string"}
_GENERATION = {  # path -> the media type of its stream
    "/v1/completions": "text/event-stream",
    "/v1/chat/completions": "text/event-stream",
    "/generate": "application/x-ndjson",
}


def install_openapi(app: FastAPI) -> None:
    def schema() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _build(app)
        return app.openapi_schema

    app.openapi = schema  # type: ignore[method-assign]


def _build(app: FastAPI) -> dict[str, Any]:
    spec = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = spec.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    _, defs = models_json_schema(
        [(m, "serialization") for m in (ErrorResponse, *_ANSWERS.values())],
        ref_template="#/components/schemas/{model}",
    )
    components.update(defs["$defs"])
    error = _json_ref("ErrorResponse")
    for path, ops in spec["paths"].items():
        for op in ops.values():
            responses = op["responses"]
            responses.pop("422", None)
            if path in _ANSWERS:
                responses["200"]["content"] |= _json_ref(_ANSWERS[path].__name__)
            if path == "/health":
                codes = []
                responses["503"] = {"description": _STATUS["503"], "content": _json_ref("Health")}
            elif path in ("/metrics", "/openapi.json"):
                codes = []
            elif path in _TOKENIZING:
                codes = ["400", "401", "404", "408", "413"]
            elif path in _GENERATION:
                codes = [code for code in _STATUS if code != "409"]
                ok = responses["200"]["content"]
                media = _GENERATION[path]
                ok[media] = {"schema": _SSE_EVENT if media == "text/event-stream" else _TEXT}
            elif _ANSWERS.get(path) is WeightState:  # serve/weights.py
                codes = ["400", "401", "408", "409", "413", "500", "503"]
            else:
                codes = ["401"]
            for code in codes:
                responses[code] = {"description": _STATUS[code], "content": error}
    spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"] = {
        "text/plain": {"schema": {"type": "string"}}
    }
    return spec


def _json_ref(name: str) -> dict[str, Any]:
    return {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}}
