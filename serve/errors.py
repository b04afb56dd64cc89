"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` for every failure.

Engine exceptions map to HTTP statuses here, in one place: bad input 400 (`param` from the
`ParameterError`'s field, or from pydantic's location), full waiting queue 429 (with
Retry-After), request timeout 504, engine not taking requests 503, engine died 500, a request the
engine failed alone 500.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from nori_jax.async_engine import (
    EngineDeadError,
    EngineStoppedError,
    RequestFailedError,
    RequestTimeoutError,
)
from nori_jax.core.scheduler import QueueFullError
from nori_jax.sampling_params import ParameterError
from nori_jax.weight_control import EngineAsleepError, EngineBusyError

logger = logging.getLogger(__name__)


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param)


def parameter_error(exc: ParameterError, prompt_param: str = "prompt") -> ApiError:
    """The 400 for a ParameterError; a prompt's fault is named by the route's own prompt field
    (`messages` for a chat)."""
    return bad_request(str(exc), prompt_param if exc.param == "prompt" else exc.param)


def api_error_from(exc: BaseException, retry_after_s: int = 1) -> ApiError:
    """The HTTP error for an exception raised by the engine (or anything else)."""
    if isinstance(exc, ApiError):
        return exc
    retry = {"Retry-After": str(retry_after_s)}
    if isinstance(exc, QueueFullError):
        return ApiError(
            429,
            f"server overloaded: {exc}; retry later",
            "rate_limit_error",
            code="queue_full",
            headers=retry,
        )
    if isinstance(exc, RequestTimeoutError):
        return ApiError(504, str(exc), "timeout_error", code="request_timeout")
    if isinstance(exc, (EngineStoppedError, EngineAsleepError)):  # back later: 503
        code = "engine_asleep" if isinstance(exc, EngineAsleepError) else "engine_unavailable"
        return ApiError(503, str(exc), "server_error", code=code, headers=retry)
    if isinstance(exc, EngineDeadError):
        return ApiError(500, str(exc), "server_error", code="engine_dead")
    if isinstance(exc, RequestFailedError):
        return ApiError(500, str(exc), "server_error", code="request_failed")
    if isinstance(exc, EngineBusyError):
        return ApiError(409, str(exc), "invalid_request_error", code="engine_busy")
    if isinstance(exc, ParameterError):
        return bad_request(str(exc), exc.param)
    if isinstance(exc, ValueError):
        return bad_request(str(exc))
    logger.error("unexpected error", exc_info=exc)
    return ApiError(
        500, f"internal error: {type(exc).__name__}: {exc}", "server_error", code="internal_error"
    )


FASTAPI_PARSE_ERROR = "There was an error parsing the body"
_TYPE_NAMES = {"str", "int", "float", "bool", "none", "dict", "list"}


def _is_union_tag(part: str | int) -> bool:
    # pydantic puts the union member tried into the location ("prompt.list[int]"); our field
    # names are snake_case, the members are builtin types, generics, constrained types
    # ("constrained-str") or model classes.
    return isinstance(part, str) and (
        "[" in part or "-" in part or part in _TYPE_NAMES or part[:1].isupper()
    )


_NO_TYPE_MATCHES = "no accepted type matches this value"
_MAX_FIELDS_SAID = 5  # fields at fault one 400 names


def _is_type_mismatch(error_type: str) -> bool:
    """pydantic's complaint that a value is not of a union member's type at all ("string_type",
    "int_parsing", ...), as opposed to a check on the content of a value that is."""
    return error_type.endswith(("_type", "_parsing")) or error_type == "is_instance_of"


def validation_error(errors: Sequence[Mapping[str, Any]]) -> ApiError:
    """One 400 for all of pydantic's complaints (`ValidationError.errors()`, FastAPI's or
    pydantic's own), `param` naming the first field at fault."""
    by_field: dict[str, list[str]] = {}
    checks: dict[str, str] = {}  # per field, the first complaint of a check on a value's content
    for e in errors:
        if e.get("type") == "json_invalid":
            detail = e.get("ctx", {}).get("error", e.get("msg"))
            return bad_request(f"invalid JSON in the request body: {detail}")
        loc = [x for x in e.get("loc", ()) if x != "body"]
        if not loc:  # the body as a whole: not JSON at all, or JSON but not an object
            return bad_request(
                "the request body must be a JSON object (with Content-Type: application/json)"
            )
        if "[key]" in loc:  # a bad key of a mapping (logit_bias): name the mapping, not the
            loc = loc[: max(loc.index("[key]") - 1, 1)]  # client's key, which may be any text
        tags = [i for i, x in enumerate(loc) if _is_union_tag(x)]
        field = ".".join(str(x) for x in loc[: tags[0] if tags else len(loc)])
        if field not in by_field and len(by_field) == _MAX_FIELDS_SAID:
            # A field's errors come together, so the ones said are complete: stop (a body of
            # half a million unknown keys has as many errors, seconds of the event loop's time)
            break
        msg = str(e.get("msg"))
        kind = str(e.get("type"))
        if kind == "extra_forbidden":
            msg = "this field is not supported by this server"
        if kind == "value_error":  # a validator's ValueError (protocol.unicode_text)
            msg = msg.removeprefix("Value error, ")
        if tags and not _is_type_mismatch(kind):
            # A union member whose type matched and whose content a check refused: its
            # complaint, at its place inside the value ("prompt.0", "stop.3").
            inner = [str(x) for x in loc[tags[0] :] if not _is_union_tag(x)]
            checks.setdefault(field, f"{'.'.join([field, *inner])}: {msg}")
        elif kind == "value_error":
            checks.setdefault(field, f"{field}: {msg}" if field else msg)
        by_field.setdefault(field, []).append(f"{field}: {msg}" if field else msg)
    parts = []
    for field, msgs in by_field.items():
        # A union field reports each member's complaint; one line says it better: the member
        # whose type matched and whose content a check refused, else that no type matched.
        parts.append(
            msgs[0] if len(msgs) == 1 else checks.get(field, f"{field}: {_NO_TYPE_MATCHES}")
        )
    param = next(iter(by_field), None) or None
    return bad_request("; ".join(parts) or "invalid request body", param)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's default is a 422 with {"detail": [...]}: clients of OpenAI's API expect 400
        # and the error object.
        return validation_error(exc.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        detail = str(exc.detail)
        cause = exc.__cause__
        if exc.status_code == 400 and cause is not None and detail == FASTAPI_PARSE_ERROR:
            # FastAPI's word for a body json.loads refused other than by a syntax error (nested
            # too deeply, an integer of over 4,300 digits, bytes that are not UTF-8): say which
            detail = f"invalid JSON in the request body: {type(cause).__name__}: {str(cause):.200}"
        return ApiError(exc.status_code, detail, kind, headers=exc.headers).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        # A bug, not bad input (routes convert engine errors themselves): always a 500.
        logger.exception("unhandled error")
        return ApiError(
            500,
            f"internal error: {type(exc).__name__}: {exc}",
            "server_error",
            code="internal_error",
        ).response()
