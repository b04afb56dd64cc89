"""POST /tokenize and /detokenize (vLLM's extension routes) on a real server: the ids the
generation routes would use for a text or for chat messages, text back from ids, and a 4xx with a
JSON body for what they cannot do."""

from __future__ import annotations

import httpx
import pytest
from serve_harness import (
    CHAT_TEMPLATE,
    MODEL_NAME,
    Server,
    assert_error,
    client,
    post_raw,
    running_server,
)


@pytest.fixture(scope="module")
def server():
    with running_server() as s:
        yield s


@pytest.fixture()
def c(server: Server):
    with client(server) as c:
        yield c


def test_a_text_gives_the_generation_routes_ids(server: Server, c: httpx.Client) -> None:
    r = c.post("/tokenize", json={"model": MODEL_NAME, "prompt": "Hello, world"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == server.engine.tokenize("Hello, world")
    assert body["count"] == len(body["tokens"]) and body["token_strs"] is None
    assert body["max_model_len"] == server.engine.max_model_len
    back = c.post("/detokenize", json={"tokens": body["tokens"]}).json()["prompt"]
    assert back.endswith("Hello, world")  # after the tokenizer's own special tokens, if any
    plain = c.post("/tokenize", json={"prompt": "Hello, world", "add_special_tokens": False})
    assert c.post("/detokenize", json={"tokens": plain.json()["tokens"]}).json() == {
        "prompt": "Hello, world"
    }


def test_messages_give_the_chat_routes_prompt(c: httpx.Client) -> None:
    messages = [{"role": "user", "content": "Hi there"}]
    ids = c.post("/tokenize", json={"messages": messages}).json()["tokens"]
    answer = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
    assert len(ids) == answer.json()["usage"]["prompt_tokens"]
    bare = c.post("/tokenize", json={"messages": messages, "add_generation_prompt": False})
    assert len(bare.json()["tokens"]) < len(ids)  # without the assistant's opening


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/detokenize", {"tokens": [1, 10**6]}, "tokens"),  # past the vocabulary
        ("/detokenize", {"tokens": [-1]}, "tokens.0"),
        ("/detokenize", {"tokens": "12"}, "tokens"),
        ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "prompt"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "x" * 100_000}, "prompt"),  # more than the model can hold
        ("/tokenize", {"messages": []}, "messages"),
        ("/tokenize", {"messages": [{"role": "user", "content": "x" * 100_000}]}, "messages"),
        ("/tokenize", {"prompt": "x", "top_k": 3}, "top_k"),  # not a field of the route
        # fields of a chat's rendering, with a text prompt: they would do nothing
        ("/tokenize", {"prompt": "x", "add_generation_prompt": False}, "add_generation_prompt"),
        ("/tokenize", {"prompt": "x", "chat_template_kwargs": {}}, "chat_template_kwargs"),
    ],
)
def test_bad_bodies(c: httpx.Client, path: str, body: dict, param: str | None) -> None:
    err = assert_error(c.post(path, json=body), 400, param)
    assert len(err["message"]) < 1000
    if body == {}:
        assert "not both" not in err["message"]  # neither was given


def test_a_lone_surrogate_is_no_text(c: httpx.Client) -> None:
    assert_error(post_raw(c, "/tokenize", rb'{"prompt": "\ud800"}'), 400, "prompt")


def test_unknown_model(c: httpx.Client) -> None:
    assert_error(c.post("/tokenize", json={"model": "gpt-9", "prompt": "x"}), 404, "model")


def test_tokenizer_info_is_what_a_remote_tokenizer_reads(server: Server, c: httpx.Client) -> None:
    """GET /tokenizer_info (vLLM's route; lm-evaluation-harness's remote tokenizer probes it for
    `eos_token`, then tokenizes with /tokenize): the served tokenizer's special tokens, ids and
    limits."""
    r = c.get("/tokenizer_info")
    assert r.status_code == 200, r.text
    info = r.json()
    tok = server.engine.tokenizer
    assert {k: info[k] for k in ("bos_token", "eos_token", "pad_token", "chat_template")} == {
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
        "pad_token": tok.pad_token,
        "chat_template": CHAT_TEMPLATE,  # the server's (--chat-template), as the chat route's
    }
    assert info["eos_token_ids"] == list(tok.eos_token_ids) and info["vocab_size"] == tok.vocab_size
    assert info["model_max_length"] == server.engine.max_model_len
    probe = c.post("/tokenize", json={"prompt": "test", "add_special_tokens": False})
    assert isinstance(probe.json()["tokens"], list)
