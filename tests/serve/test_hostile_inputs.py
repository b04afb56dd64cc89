"""A hostile client's requests: each gets a prompt 4xx with a JSON error naming what is wrong.

Bodies here are at most a few MB (this module's server takes 8 MiB, the default), sent to a
server with the harness's chat template.
"""

from __future__ import annotations

import json
import socket

import httpx
import pytest
from pydantic import ValidationError
from serve_harness import Server, assert_error, client, post_raw, running_server

from serve.choices import MAX_CHOICES
from serve.protocol import (
    MAX_MESSAGES,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
)


@pytest.fixture(scope="module")
def server():
    with running_server() as s:
        yield s


@pytest.fixture
def c(server: Server):
    with client(server) as http:
        yield http


def _raw_answer(server: Server, request: bytes) -> bytes:
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(request)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    return answer


@pytest.mark.parametrize(
    "head, why",
    [
        (b"Content-Length: -1", "Content-Length"),
        (b"Content-Length: 5\r\nTransfer-Encoding: chunked", "Transfer-Encoding"),
    ],
)
def test_a_request_that_is_not_http_gets_a_json_400(server: Server, head: bytes, why: str):
    # uvicorn answered a text/plain "Invalid HTTP request received.", without the parser's reason
    answer = _raw_answer(
        server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + head + b"\r\n\r\n{}"
    )
    status, _, rest = answer.partition(b"\r\n")
    assert status == b"HTTP/1.1 400 Bad Request", answer[:200]
    headers, _, body = rest.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in headers.lower()
    err = json.loads(body)["error"]
    assert err["code"] == "invalid_http_request"
    assert err["message"].startswith("invalid HTTP request: ") and why in err["message"], err


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_a_template_kwarg_the_renderer_reserves_is_refused_by_name(c: httpx.Client, path: str):
    # was a 400 naming `messages` and Python's "got multiple values for argument 'self'"
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"self": 1}}
    err = assert_error(c.post(path, json=body), 400, "chat_template_kwargs")
    assert "'self'" in err["message"] and "argument" not in err["message"], err


# Bodies of a few MB whose every item is wrong: each was millions of validation errors (one per
# item and member of the prompt's union), listed on the event loop for seconds (13 s for the
# first on a fast core); now the first bad item answers at once.
MANY_BAD_ITEMS = [
    ("/v1/completions", b'{"prompt":[' + b",".join([b'1,""'] * 300_000) + b"]}", "prompt", None),
    ("/v1/completions", b'{"prompt":[' + b"1," * 1_000_000 + b"-1]}", "prompt", "prompt.1000000"),
    ("/generate", b'{"prompt":[' + b"-1," * 1_000_000 + b"1]}", "prompt", "prompt.0"),
    ("/detokenize", b'{"tokens":[' + b"-1," * 1_000_000 + b"1]}", "tokens.0", "tokens.0"),
    (
        "/v1/chat/completions",
        b'{"messages":[' + b",".join([b'{"role":1}'] * 16_000) + b"]}",  # (more: counted)
        "messages.0.role",
        "messages.0.role",
    ),
    (
        "/tokenize",
        b'{"messages":[{"role":"u","content":[' + b",".join([b"[]"] * 16_000) + b"]}]}",
        "messages.0.content",
        None,
    ),
]


@pytest.mark.parametrize("path, raw, param, where", MANY_BAD_ITEMS)
def test_a_body_of_many_bad_items_is_refused_at_once(
    c: httpx.Client, path: str, raw: bytes, param: str, where: str | None
) -> None:
    err = assert_error(post_raw(c, path, raw), 400, param)
    if where is not None:
        assert err["message"].startswith(f"{where}: "), err
    assert len(err["message"]) < 500, err  # the first fault, not a million of them


def test_the_first_bad_item_ends_the_validation() -> None:
    """What made the bodies above slow, counted rather than timed: pydantic now stops a list
    at its first bad item (it made an error per item and per member of the prompt's union)."""
    for model, raw in [
        (CompletionRequest, MANY_BAD_ITEMS[1][1]),
        (DetokenizeRequest, MANY_BAD_ITEMS[3][1]),
        (ChatCompletionRequest, MANY_BAD_ITEMS[4][1]),
    ]:
        with pytest.raises(ValidationError) as e:
            model.model_validate_json(raw)
        assert e.value.error_count() <= 4, (model, e.value.error_count())  # one per union member


MANY_MESSAGES = {"role": "user", "content": "hi"}


@pytest.mark.parametrize(
    "path, body, param, says",
    [
        (
            "/v1/chat/completions",
            {"messages": [MANY_MESSAGES] * (MAX_MESSAGES + 1)},
            "messages",
            f"{MAX_MESSAGES + 1} messages; at most {MAX_MESSAGES}",
        ),
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 9000}] * 2},
            "messages",
            f"18000 content parts in all; at most {MAX_MESSAGES}",
        ),
        (
            "/v1/completions",
            {"prompt": ["hi"] * (MAX_CHOICES + 1)},
            "prompt",
            f"a batch of {MAX_CHOICES + 1} prompts; at most {MAX_CHOICES}",
        ),
    ],
)
def test_lists_of_objects_are_counted_before_their_items_are_read(
    c: httpx.Client, path: str, body: dict, param: str, says: str
) -> None:
    """Validating a list's objects holds the event loop (0.9 s for the 250,000 messages an 8 MB
    body holds, every stream of the API server stalled): their counts are checked first. Each of
    these was validated item by item, then refused later (or, for messages, rendered and
    tokenized) with another message."""
    err = assert_error(c.post(path, json=body), 400, param)
    assert says in err["message"], err


def test_the_counts_are_limits_not_less() -> None:
    ChatCompletionRequest.model_validate({"messages": [MANY_MESSAGES] * MAX_MESSAGES})
    CompletionRequest.model_validate({"prompt": ["hi"] * MAX_CHOICES})
    CompletionRequest.model_validate({"prompt": list(range(100_000))})  # ids: no batch
