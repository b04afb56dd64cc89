"""/openapi.json as the server really answers: the error object on every status a route can give
(400, never FastAPI's 422), the streaming media types, the generation routes' JSON bodies."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


_STATUS = {
    "400": "invalid request: bad JSON, a field of the wrong type or out of range, an "
    "unsupported field, a prompt that does not fit (param names the field)",
    "401": "missing or wrong API key (when the server has one)",
    "404": "the model named is not served",
    "408": "the request body did not arrive in time",
    "413": "the request body is larger than the server takes",
    "429": "the waiting queue is full (see Retry-After)",
    "500": "the engine died while the request was in flight, or failed this request",
    "503": "the engine is not serving: shutting down or restarting (see Retry-After)",
    "504": "the request ran past the server's request timeout",
}
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
    components["ErrorDetail"] = ErrorDetail.model_json_schema()
    components["ErrorResponse"] = {
        "type": "object",
        "properties": {"error": {"$ref": "#/components/schemas/ErrorDetail"}},
        "required": ["error"],
    }
    error = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
    for path, ops in spec["paths"].items():
        for op in ops.values():
            responses = op["responses"]
            responses.pop("422", None)
            if path == "/health":
                codes = ["503"]
            elif path in ("/metrics", "/openapi.json"):
                codes = []
            elif path in _GENERATION:
                codes = list(_STATUS)
                ok = responses["200"]["content"]
                ok[_GENERATION[path]] = {"schema": {"type": "string"}}
            else:
                codes = ["401"]
            for code in codes:
                responses[code] = {"description": _STATUS[code], "content": error}
    spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"] = {
        "text/plain": {"schema": {"type": "string"}}
    }
    return spec
