"""The OpenAI Batch API's line formats.

Input, one request per line:

    {"custom_id": "doc-1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

Output, one line per request, in the order requests finish:

    {"id": "batch_req_...", "custom_id": "doc-1",
     "response": {"status_code": 200, "request_id": "chatcmpl-...", "body": {...}}, "error": null}

`body` is what the server answers the same request: the completion, or its error object with
the status the server would send (400 for a bad body, 404 for another model's name, 500 for a
request the engine failed). A line that is not a request at all (not JSON, no custom_id, another
method or url) has `"response": null` and `"error": {"code", "message"}` naming its line number.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from serve.streaming import dumps

URLS = ("/v1/completions", "/v1/chat/completions")


class BatchLine(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    custom_id: str = Field(min_length=1)
    method: Literal["POST"]
    url: Literal["/v1/completions", "/v1/chat/completions"]
    body: dict[str, Any]


def response_record(
    custom_id: str, request_id: str, status_code: int, body: dict[str, Any]
) -> dict[str, Any]:
    response = {"status_code": status_code, "request_id": request_id, "body": body}
    return {"id": _record_id(), "custom_id": custom_id, "response": response, "error": None}


def line_error_record(custom_id: str | None, code: str, message: str) -> dict[str, Any]:
    error = {"code": code, "message": message}
    return {"id": _record_id(), "custom_id": custom_id, "response": None, "error": error}


def encode(record: dict[str, Any]) -> bytes:
    """One output line (JSON with no raw line breaks inside, then a newline)."""
    return (dumps(record) + "\n").encode()


def _record_id() -> str:
    return f"batch_req_{uuid.uuid4().hex}"
