"""Every failure path over HTTP gives an OpenAI-style error body, and none disturbs other requests.

This module's server requires an API key, times requests out after 2 s, takes bodies of up to
64 KiB read within 1 s, and headers within 1 s.
"""

from __future__ import annotations

import dataclasses
import json
import re
import socket
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
from serve_harness import MODEL_NAME, Server, assert_error, client, post_raw, running_server

from serve.convert import chat_prompt
from serve.errors import ApiError
from serve.protocol import ChatCompletionRequest

KEY = "sk-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_BODY = 64 * 1024


@pytest.fixture(scope="module")
def server():
    settings = {
        "api_key": KEY,
        "request_timeout_s": 2.0,
        "max_body_bytes": MAX_BODY,
        "body_timeout_s": 1.0,
        "header_timeout_s": 1.0,
    }
    with running_server(settings) as s:
        yield s


@pytest.fixture
def c(server: Server):
    with client(server, headers=AUTH) as http:
        yield http


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
        ({"prompt": "x", "n": 65}, "n"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "n": 2, "best_of": 3}, "best_of"),
        ({"prompt": "", "max_tokens": 4}, "prompt"),
        ({"prompt": [], "max_tokens": 4}, "prompt"),
        ({"prompt": ["a"] * 129, "n": 2}, "prompt"),  # 258 choices: past 256
        ({"prompt": ["a", ""]}, "prompt.1"),  # a batch names the prompt at fault
        ({"prompt": [1, 2, 512]}, "prompt"),  # the vocabulary is [0, 512)
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "top_k": -5}, "top_k"),
        ({"prompt": "x", "min_p": 1.5}, "min_p"),
        ({"prompt": "x", "min_p": -0.5}, "min_p"),
        ({"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias.5"),
        ({"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"-3": 1}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"512": 1}}, "logit_bias"),  # past the vocabulary
        ({"prompt": "x", "logit_bias": {"99999999999": 1}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"7" * 5000: 1}}, "logit_bias"),  # not echoed back
        ({"prompt": "x", "logit_bias": {str(i): 1 for i in range(257)}}, "logit_bias"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),  # past MAX_LOGPROBS
        ({"prompt": "x", "seed": -1}, "seed"),
        ({"prompt": "x", "stop": [""]}, "stop"),
        ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),  # OpenAI's [-2, 2]
        ({"prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
        ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),  # [0.01, 100]
        ({"prompt": "x", "repetition_penalty": 1e30}, "repetition_penalty"),
        ({"prompt": "x", "min_tokens": -1}, "min_tokens"),
        ({"prompt": "x", "max_tokens": 4, "min_tokens": 5}, "min_tokens"),  # past max_tokens
        ({"prompt": "x", "priority": 1}, "priority"),  # the server's policy is FCFS
        ({"prompt": "x", "priority": 2**31}, "priority"),
    ],
)
def test_bad_values(c: httpx.Client, body: dict, param: str) -> None:
    err = assert_error(c.post("/v1/completions", json=body), 400, param)
    assert len(err["message"]) < 1000, err  # nothing of the client's echoed at length


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        # a union field says which check the value of the member that matched failed, and where
        ({"prompt": "x", "stop": [f"s{i}" for i in range(17)]}, "stop", "at most 16 items"),
        (
            {"prompt": "x", "stop": ["ok", "x" * 257]},
            "stop",
            "stop.1: a stop string of 257 characters; it needs 1 to 256",
        ),
        ({"prompt": [3, -5]}, "prompt", "prompt.1: Input should be greater than or equal to 0"),
        ({"prompt": [[1], [2**40]]}, "prompt", "prompt.1.0: Input should be less than or equal"),
        # no member's type matches at all
        ({"prompt": {"a": 1}}, "prompt", "prompt: no accepted type matches this value"),
    ],
)
def test_union_fields_say_what_failed(c: httpx.Client, body: dict, param: str, message: str):
    err = assert_error(c.post("/v1/completions", json=body), 400, param)
    assert message in err["message"], err


def test_answers_too_big_in_top_logprobs_are_refused(c: httpx.Client) -> None:
    """n x max_tokens x (top logprobs + 1) past the server's bound (2**18 by default) is a 400
    naming the field that asks for them, with the product; within it, an answer."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 20}
    err = assert_error(
        c.post("/v1/chat/completions", json=chat | {"n": 64, "max_tokens": 200}),
        400,
        "top_logprobs",
    )
    assert "64 x 200 x 21 = 268800" in err["message"], err
    body = {"prompt": "x", "logprobs": 20, "n": 64, "max_tokens": 196}  # 263,424: one token over
    err = assert_error(c.post("/v1/completions", json=body), 400, "logprobs")
    assert "64 x 196 x 21 = 263424" in err["message"], err
    ok = c.post("/v1/completions", json={"prompt": "x", "logprobs": 3, "n": 2, "max_tokens": 2})
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["logprobs"]["top_logprobs"]) == 2


def test_the_logprob_bound_counts_each_token_and_its_alternatives() -> None:
    """The bound in numbers (this module's server holds too few tokens to reach the default):
    top_logprobs k counts k + 1 a token; the sampled tokens' logprobs alone are not bounded
    (accepted before top logprobs existed, they still are)."""
    from serve.chat import ChatCompletion
    from serve.errors import ApiError
    from serve.protocol import ChatCompletionRequest
    from serve.settings import ServerSettings

    ctx = SimpleNamespace(
        settings=ServerSettings("m", max_logprob_entries=1000), max_model_len=10_000
    )
    msgs = [{"role": "user", "content": "hi"}]
    route = ChatCompletion(ctx, ChatCompletionRequest(messages=msgs, logprobs=True, n=10))
    wide = dict(messages=msgs, logprobs=True, n=10, max_tokens=1001)
    ChatCompletion(ctx, ChatCompletionRequest(**wide)).sampling_params(prompt_len=5)
    with pytest.raises(ApiError, match="10 x 1001 x 2 = 20020"):  # through the route's settings
        ChatCompletion(ctx, ChatCompletionRequest(**wide, top_logprobs=1)).sampling_params(5)
    route._check_logprob_entries(3, 25, "max_tokens")  # 10 x 25 x 4: at the bound
    with pytest.raises(ApiError) as e:
        route._check_logprob_entries(3, 26, "max_tokens")
    assert (e.value.status, e.value.param) == (400, "top_logprobs")
    assert "10 x 26 x 4 = 1040" in e.value.message


def test_the_logprob_bound_counts_every_prompt_token_scored() -> None:
    """Echo with logprobs scores the prompt: its tokens count too, in every choice of every prompt
    of a batch, and even with logprobs 0 (new with echo: nothing accepted before is refused)."""
    from serve.completions import Completion
    from serve.errors import ApiError
    from serve.protocol import CompletionRequest
    from serve.settings import ServerSettings

    ctx = SimpleNamespace(
        settings=ServerSettings("m", max_logprob_entries=1000), max_model_len=10_000
    )
    body = CompletionRequest(prompt=[[5] * 9] * 50, echo=True, logprobs=0, max_tokens=1, n=2)
    route = Completion(ctx, body)
    route.check()
    assert route.sampling_params(prompt_len=9).prompt_logprobs == 0  # 100 x (9 + 1) x 1
    with pytest.raises(ApiError, match=r"100 x 11 x 1 = 1100") as e:
        route.sampling_params(prompt_len=10)
    assert e.value.param == "logprobs"
    plain = Completion(ctx, CompletionRequest(prompt=[[5] * 9] * 50, logprobs=0, max_tokens=40))
    plain.check()
    assert plain.sampling_params(prompt_len=9).prompt_logprobs is None  # not bounded, as before


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
    body = {"messages": msgs, "top_logprobs": 21, "logprobs": True}
    assert_error(c.post("/v1/chat/completions", json=body), 400, "top_logprobs")
    body = {"messages": msgs, "top_logprobs": 3}  # without logprobs: true, as OpenAI refuses it
    err = assert_error(c.post("/v1/chat/completions", json=body), 400, "top_logprobs")
    assert "logprobs" in err["message"]
    for reserved in ("messages", "add_generation_prompt"):  # the request's own fields set them
        body = {"messages": msgs, "chat_template_kwargs": {reserved: []}}
        err = assert_error(c.post("/v1/chat/completions", json=body), 400, "chat_template_kwargs")
        assert reserved in err["message"] and "apply_chat_template" not in err["message"]
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    err = assert_error(
        c.post("/v1/chat/completions", json={"messages": image}), 400, "messages.0.content.0"
    )
    assert "only text content parts" in err["message"]
    textless = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text"}]}]
    err = assert_error(
        c.post("/v1/chat/completions", json={"messages": textless}), 400, "messages.0.content.1"
    )
    assert "needs its text" in err["message"]


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
        b'{"prompt": "x", "n": 65}',
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


# ---- strict types and bounds: no input gets a 5xx or reaches the engine's arrays unchecked ----


@pytest.mark.parametrize(
    ("path", "raw", "param"),
    [
        ("/v1/completions", b'{"prompt": "x", "max_tokens": "4"}', "max_tokens"),
        ("/v1/completions", b'{"prompt": "x", "stream": "yes"}', "stream"),
        ("/v1/completions", b'{"prompt": "x", "top_k": 1e10}', "top_k"),
        ("/v1/completions", b'{"prompt": "x", "seed": 100000.0}', "seed"),
        ("/v1/completions", b'{"prompt": "x", "ignore_eos": 1}', "ignore_eos"),
        ("/v1/completions", b'{"prompt": "x", "temperature": NaN}', "temperature"),
        ("/v1/completions", b'{"prompt": "x", "temperature": Infinity}', "temperature"),
        ("/v1/completions", b'{"prompt": "x", "temperature": 1e309}', "temperature"),
        ("/v1/completions", b'{"prompt": "x", "top_p": NaN}', "top_p"),
        ("/v1/completions", b'{"prompt": [1, true]}', "prompt"),
        ("/generate", b'{"prompt": "x", "max_tokens": 2.0}', "max_tokens"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": 5}]}', None),
    ],
)
def test_no_coercion(c: httpx.Client, path: str, raw: bytes, param: str | None) -> None:
    err = assert_error(post_raw(c, path, raw), 400, param)
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("path", "raw", "param"),
    [  # JSON's escapes spell lone surrogates, which a str holds but a tokenizer refuses
        ("/v1/chat/completions", rb'{"messages": [{"role": "user", "content": "a\ud800"}]}',
         "messages.0.content"),
        ("/v1/chat/completions",
         rb'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]}',
         "messages.0.content"),
        ("/v1/chat/completions", rb'{"messages": [{"role": "user\udc00", "content": "hi"}]}',
         "messages.0.role"),
        ("/v1/chat/completions",
         rb'{"messages": [{"role": "user", "content": "hi"}], "stop": ["\ud83d"]}', "stop"),
        ("/v1/completions", rb'{"prompt": "\ud800"}', "prompt"),
        ("/v1/completions", rb'{"prompt": ["x\ud800"]}', "prompt"),
        ("/generate", rb'{"prompt": "x", "stop": "\ud800"}', "stop"),
    ],
)  # fmt: skip
def test_text_that_is_not_unicode_is_refused(c: httpx.Client, path, raw, param) -> None:
    err = assert_error(post_raw(c, path, raw), 400, param)
    assert "lone surrogate" in err["message"], err
    # the same body with a real character in each surrogate's place is served
    ok = re.sub(rb"\\ud[89a-f][0-9a-f]{2}", rb"\\u00e9", raw)
    body = json.loads(ok)
    body["max_tokens"] = 2
    assert c.post(path, json=body).status_code == 200


def _chat_prompt_error(render, **kwargs) -> ApiError:
    """The ApiError chat_prompt raises for one user message and `kwargs` as chat_template_kwargs,
    over a template that returns `render(kwargs)` (and a tokenizer that must not be reached)."""

    class Template:
        chat_template = "{{ ... }}"
        longest_token_bytes = 16

        def apply_chat_template(self, messages, add_generation_prompt, **template_kwargs):
            return render(template_kwargs)

        def encode(self, text, add_special_tokens=False):
            raise AssertionError("the tokenizer must not see it")

    ctx = SimpleNamespace(tokenizer=Template(), max_model_len=64)
    req = ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}], chat_template_kwargs=kwargs
    )
    with pytest.raises(ApiError) as e:
        chat_prompt(ctx, req)
    return e.value


def test_a_template_value_nested_too_deeply_to_render_is_refused() -> None:
    """A template that renders a chat_template_kwargs value with tojson (as templates with
    tools do) recurses once per level: a value nested deeper than Python's recursion limit (yet
    within the JSON parser's) is the request's fault, a 400, not a 500."""
    deep: list = []
    for _ in range(5000):
        deep = [deep]
    err = _chat_prompt_error(lambda kw: json.dumps(kw["tools"]), tools=deep)
    assert err.status == 400 and err.param == "chat_template_kwargs"
    assert "nested too deeply" in err.message


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (b'{"prompt": ' + b"[" * 30_000 + b"]" * 30_000 + b"}", "RecursionError"),
        (b'{"prompt": "x", "seed": ' + b"9" * 5000 + b"}", "digits"),
        (b'{"prompt": "\xff\xfe"}', "UnicodeDecodeError"),
    ],
)
def test_a_body_the_json_parser_refuses_says_why(c: httpx.Client, raw: bytes, why: str) -> None:
    err = assert_error(post_raw(c, "/v1/completions", raw), 400)
    assert "invalid JSON in the request body" in err["message"] and why in err["message"], err


def test_a_rendered_chat_prompt_that_is_not_unicode_is_refused() -> None:
    """A template may put a chat_template_kwargs value (which no field type checks) into the
    prompt: the rendered text is checked before it reaches the tokenizer."""
    err = _chat_prompt_error(lambda kw: "<s>" + kw["extra"], extra="\ud800")
    assert err.status == 400 and err.param == "chat_template_kwargs"
    assert "lone surrogate '\\ud800' at character 3" in err.message


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"top_k": 2**31}, "top_k"),
        ({"top_k": 2**63}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"seed": 2**31}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"stop_token_ids": [2**31]}, "stop_token_ids.0"),
        ({"stop_token_ids": [512]}, "stop_token_ids"),  # outside the vocabulary [0, 512)
        ({"stop_token_ids": list(range(65))}, "stop_token_ids"),
        ({"stop": [f"s{i}" for i in range(17)]}, "stop"),
        ({"stop": "x" * 257}, "stop"),
        ({"stop": ["x" * 257]}, "stop"),
        ({"max_tokens": 2**31}, "max_tokens"),
        ({"logprobs": 2**40}, "logprobs"),
        ({"n": 2**70}, "n"),
        ({"prompt": [2**40]}, "prompt"),
        ({"temperature": 1e39}, "temperature"),  # a finite double, infinite as float32
    ],
)
def test_numbers_out_of_the_engines_range(server: Server, c: httpx.Client, body, param) -> None:
    r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2} | body)
    err = assert_error(r, 400, param)
    if "stop" in body and "x" * 257 in str(body["stop"]):
        assert "257 characters" in err["message"], err
    assert server.engine.is_healthy


def test_top_k_beyond_the_vocabulary_is_served(server: Server, c: httpx.Client) -> None:
    """The report that opened the robustness issue: top_k 1e10 or 2**31 killed the engine loop.
    Integers up to 2**31 - 1 are valid (top-k over the whole vocabulary); beyond, a 400."""
    r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "top_k": 2**31 - 1})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert_error(c.post("/v1/completions", json={"prompt": "hi", "top_k": 1e10}), 400, "top_k")
    assert server.engine.is_healthy


@pytest.mark.parametrize(
    ("path", "field"),
    [
        ("/v1/completions", {"response_format": {"type": "json_object"}}),
        ("/v1/completions", {"bad_words": ["x"]}),
        ("/v1/completions", {"use_beam_search": True}),
        ("/v1/completions", {"guided_choice": ["a", "b"]}),
        ("/v1/chat/completions", {"tool_choice": "auto"}),
        ("/v1/chat/completions", {"functions": [{"name": "f"}]}),
        ("/v1/chat/completions", {"response_format": {"type": "json_object"}}),
        ("/generate", {"n": 1}),
    ],
)
def test_unsupported_fields_are_refused_by_name(c: httpx.Client, path: str, field: dict) -> None:
    body = {"prompt": "x", "max_tokens": 2}
    if path == "/v1/chat/completions":
        body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    name = next(iter(field))
    err = assert_error(c.post(path, json=body | field), 400, name)
    assert "not supported" in err["message"]


def test_fields_without_effect_are_accepted(c: httpx.Client) -> None:
    r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "user": "u-1", "n": None})
    assert r.status_code == 200, r.text


# ---- bounds on the request itself ----------------------------------------------------------


def _raw_exchange(server: Server, data: bytes, wait_s: float = 5.0) -> bytes:
    """Send raw bytes, then read whatever comes back until the server closes or wait_s passes."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=wait_s) as sock:
        sock.sendall(data)
        chunks = []
        try:
            while chunk := sock.recv(65536):
                chunks.append(chunk)
                if b"\r\n\r\n" in b"".join(chunks) and b'"error"' in b"".join(chunks):
                    break
        except TimeoutError:
            pass
    return b"".join(chunks)


def test_a_body_over_the_limit_is_refused_before_it_is_read(server: Server) -> None:
    # Headers announcing a gigabyte, and no body at all: the answer comes at once.
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 1000000000\r\n\r\n"
    )
    answer = _raw_exchange(server, head)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    body = json.loads(answer.split(b"\r\n\r\n", 1)[1])
    assert body["error"]["code"] == "request_too_large"
    assert server.engine.is_healthy


def test_a_chunked_body_over_the_limit_is_refused(c: httpx.Client) -> None:
    def chunks():
        yield b'{"prompt": "'
        for _ in range(2 * MAX_BODY // 1024):
            yield b"y" * 1024
        yield b'"}'

    r = c.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert_error(r, 413, code="request_too_large")


def test_the_api_key_is_checked_before_the_body_is_read(server: Server) -> None:
    # No key, and a body that never arrives: 401 at once, not a body timeout.
    head = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"
    answer = _raw_exchange(server, head)
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]


def test_a_body_that_does_not_arrive_times_out(server: Server) -> None:
    head = (
        b"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() + b"\r\n"
        b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"
    )
    answer = _raw_exchange(server, head)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]


def test_headers_that_do_not_arrive_close_the_connection(server: Server) -> None:
    started = time.monotonic()
    answer = _raw_exchange(server, b"POST /generate HTTP/1.1\r\nHost: x\r\n", wait_s=10)
    assert answer == b""  # closed by the server, well before our own 10 s
    assert time.monotonic() - started < 8


def test_headers_past_their_bound_get_a_431(server: Server, c: httpx.Client) -> None:
    """The request line and headers are bounded (MAX_HEADER_BYTES), as the body is: headers
    sent without end are refused once past it, not held in the server's memory."""
    filler = b"".join(b"X-Filler-%d: %s\r\n" % (i, b"a" * 1000) for i in range(200))  # 200 KB
    answer = _raw_exchange(server, b"GET /health HTTP/1.1\r\nHost: x\r\n" + filler)
    assert answer.startswith(b"HTTP/1.1 431"), answer[:200]
    err = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
    assert err["code"] == "headers_too_large"
    # Large headers within the bound, on one kept-alive connection (the count is per request),
    # with a body sent in the same packets: all served.
    big = {f"x-big-{i}": "b" * 1000 for i in range(30)}
    for _ in range(3):
        r = c.post("/v1/completions", json={"prompt": "x" * 30_000, "max_tokens": 1}, headers=big)
        assert r.status_code in (200, 400), r.text  # served or refused for its length: parsed
    assert c.get("/health", headers=big).status_code == 200


def test_a_huge_prompt_is_refused_without_tokenizing_it(server: Server, c, monkeypatch) -> None:
    tok = server.llm_engine.tokenizer
    real_encode = tok.encode
    seen: list[int] = []

    def encode(text, *args, **kwargs):
        seen.append(len(text))
        return real_encode(text, *args, **kwargs)

    monkeypatch.setattr(tok, "encode", encode)
    huge = "z" * (MAX_BODY - 100)  # within the body limit, far beyond 256 tokens
    assert_error(c.post("/v1/completions", json={"prompt": huge}), 400, "prompt")
    chat = {"messages": [{"role": "user", "content": huge}]}
    assert_error(c.post("/v1/chat/completions", json=chat), 400, "messages")
    assert max(seen, default=0) < len(huge)


def test_tokenization_runs_off_the_event_loop(server: Server, c, monkeypatch) -> None:
    """A prompt whose tokenization blocks does not stop the server from answering others."""
    tok = server.llm_engine.tokenizer
    real_encode = tok.encode
    release = threading.Event()

    def encode(text, *args, **kwargs):
        if text == "block me":
            assert release.wait(30)
        return real_encode(text, *args, **kwargs)

    monkeypatch.setattr(tok, "encode", encode)
    result = {}

    def blocked() -> None:
        with client(server, headers=AUTH) as other:
            result["r"] = other.post("/generate", json={"prompt": "block me", "max_tokens": 2})

    t = threading.Thread(target=blocked)
    t.start()
    time.sleep(0.2)
    try:
        assert c.get("/health", timeout=5).status_code == 200
        assert c.post("/generate", json={"prompt": "free", "max_tokens": 2}, timeout=10).is_success
    finally:
        release.set()
        t.join(30)
    assert result["r"].status_code == 200
