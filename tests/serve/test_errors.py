"""Every failure path over HTTP gives an OpenAI-style error body, and none disturbs other requests.

This module's server requires an API key and times requests out after 2 s.
"""

from __future__ import annotations

import dataclasses
import json
import threading

import httpx
import pytest
from serve_harness import MODEL_NAME, Server, client, running_server

KEY = "sk-test"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server():
    with running_server({"api_key": KEY, "request_timeout_s": 2.0}) as s:
        yield s


@pytest.fixture
def c(server: Server):
    with client(server, headers=AUTH) as http:
        yield http


def assert_error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def post_raw(c: httpx.Client, path: str, body: bytes) -> httpx.Response:
    return c.post(path, content=body, headers={"Content-Type": "application/json"})


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/generate"])
def test_invalid_json(c: httpx.Client, path: str) -> None:
    err = assert_error(post_raw(c, path, b'{"prompt": "x",'), 400)
    assert err["type"] == "invalid_request_error" and "JSON" in err["message"]
    # JSON that is not an object, and a body sent as a form.
    assert "JSON object" in assert_error(post_raw(c, path, b'["x"]'), 400)["message"]
    r = c.post(
        path, content=b"prompt=x", headers={"Content-Type": "application/x-www-form-urlencoded"}
    )
    assert "JSON object" in assert_error(r, 400)["message"]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"max_tokens": 4}, "prompt"),  # missing
        ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
        ("/v1/completions", {"prompt": {"text": "x"}}, "prompt"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, "messages.0.role"),
        ("/generate", {"prompt": "x", "stream": "sometimes"}, "stream"),
    ],
)
def test_invalid_fields(c: httpx.Client, path: str, body: dict, param: str) -> None:
    assert_error(c.post(path, json=body), 400, param)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "n": 2}, "n"),
        ({"prompt": "", "max_tokens": 4}, "prompt"),
        ({"prompt": [], "max_tokens": 4}, "prompt"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": [1, 2, 512]}, "prompt"),  # the vocabulary is [0, 512)
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "top_k": -5}, "top_k"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "logprobs": 5}, "logprobs"),
        ({"prompt": "x", "seed": -1}, "seed"),
        ({"prompt": "x", "stop": [""]}, "stop"),
        ({"prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
        ({"prompt": "x", "echo": True}, "echo"),
    ],
)
def test_bad_values(c: httpx.Client, body: dict, param: str) -> None:
    assert_error(c.post("/v1/completions", json=body), 400, param)


def test_prompt_too_long(c: httpx.Client) -> None:
    assert_error(c.post("/v1/completions", json={"prompt": "x" * 256}), 400, "prompt")
    assert_error(c.post("/v1/completions", json={"prompt": [7] * 300}), 400, "prompt")
    assert_error(c.post("/generate", json={"prompt": "x" * 400}), 400, "prompt")
    chat = {"messages": [{"role": "user", "content": "x" * 300}]}
    assert_error(c.post("/v1/chat/completions", json=chat), 400, "messages")
    # A prompt that fits, with more new tokens than the model length leaves room for.
    assert_error(
        c.post("/v1/completions", json={"prompt": "x" * 200, "max_tokens": 100}), 400, "max_tokens"
    )


def test_chat_rejections(c: httpx.Client) -> None:
    msgs = [{"role": "user", "content": "hi"}]
    body = {"messages": msgs, "tools": [{"type": "function", "function": {"name": "f"}}]}
    assert_error(c.post("/v1/chat/completions", json=body), 400, "tools")
    body = {"messages": msgs, "top_logprobs": 3, "logprobs": True}
    assert_error(c.post("/v1/chat/completions", json=body), 400, "top_logprobs")
    body = {"messages": msgs, "chat_template_kwargs": {"messages": []}}
    assert_error(c.post("/v1/chat/completions", json=body), 400, "messages")
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    assert_error(
        c.post("/v1/chat/completions", json={"messages": image}), 400, "messages.0.content"
    )


def test_unknown_model_and_route(c: httpx.Client) -> None:
    err = assert_error(
        c.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"}),
        404,
        "model",
        "model_not_found",
    )
    assert MODEL_NAME in err["message"]
    assert_error(c.get("/v1/nothing"), 404)
    assert_error(c.get("/v1/completions"), 405)


def test_api_key(server: Server) -> None:
    body = {"prompt": "x", "max_tokens": 2}
    with client(server) as anon:
        for path in ("/v1/completions", "/generate"):
            err = assert_error(anon.post(path, json=body), 401, code="invalid_api_key")
            assert err["type"] == "authentication_error"
        r = anon.post("/v1/completions", json=body, headers={"Authorization": "Bearer wrong"})
        assert_error(r, 401)
        assert_error(anon.get("/v1/models"), 401)
        # Probes and scrapers need no key.
        assert anon.get("/health").status_code == 200
        assert anon.get("/metrics").status_code == 200
        r = anon.post("/v1/completions", json=body, headers=AUTH)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_timeout(server: Server, c: httpx.Client, slow_steps) -> None:
    start_free = server.free_pages()
    long = {"prompt": "slow", "max_tokens": 200, "ignore_eos": True}
    err = assert_error(c.post("/v1/completions", json=long), 504, code="request_timeout")
    assert err["type"] == "timeout_error"
    with c.stream("POST", "/v1/completions", json=long | {"stream": True}) as r:
        assert r.status_code == 200
        events = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "request_timeout"
    assert len(events) > 3  # some tokens came before the timeout
    server.wait_idle()
    assert server.free_pages() == start_free


def test_bad_requests_do_not_disturb_others(server: Server, c: httpx.Client, slow_steps) -> None:
    body = {"prompt": "steady", "max_tokens": 30, "temperature": 0, "ignore_eos": True}
    expected = c.post("/generate", json=body).json()["token_ids"]
    got: list[int] = []

    def stream() -> None:
        with client(server, headers=AUTH) as other:
            with other.stream("POST", "/generate", json=body | {"stream": True}) as r:
                for line in r.iter_lines():
                    got.extend(json.loads(line)["token_ids"])

    t = threading.Thread(target=stream)
    t.start()
    bad = [
        b"{",
        b'{"prompt": [99999]}',
        b'{"prompt": "x", "n": 3}',
        b'{"prompt": "' + b"y" * 999 + b'"}',
        b'{"prompt": "x", "top_p": 7}',
        b"[]",
        b'{"prompt": null}',
    ]
    for _ in range(5):
        for body_bytes in bad:
            assert post_raw(c, "/v1/completions", body_bytes).status_code == 400
    t.join(60)
    assert got == expected
    assert server.engine.is_healthy


def test_chat_without_a_template(server: Server, c: httpx.Client, monkeypatch) -> None:
    ctx = server.uvicorn.config.app.state.ctx
    monkeypatch.setattr(ctx, "tokenizer", dataclasses.replace(ctx.tokenizer, chat_template=None))
    body = {"messages": [{"role": "user", "content": "hi"}]}
    err = assert_error(c.post("/v1/chat/completions", json=body), 400, "messages")
    assert "--chat-template" in err["message"]
