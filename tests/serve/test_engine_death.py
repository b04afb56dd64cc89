"""A request the engine fails alone ends with a 500 of its own while the others go on; if the
engine loop itself dies, every request in flight ends with a 500 (a stream with an error event),
/health turns 503, and new requests are refused with 503."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from serve_harness import Server, client, running_server

from nori_jax.core.output_processor import OutputProcessor
from nori_jax.core.scheduler_output import Acquire

POISON_SEED = 4242


@pytest.fixture(scope="module")
def server():
    with running_server() as s:
        yield s


def _steady(server: Server, out: dict) -> None:
    body = {"prompt": "steady", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    with client(server) as c:
        with c.stream("POST", "/generate", json=body | {"stream": True}) as r:
            out["tokens"] = [t for line in r.iter_lines() for t in json.loads(line)["token_ids"]]


def test_a_request_whose_settings_break_the_step_fails_alone(server: Server, monkeypatch) -> None:
    builder = server.llm_engine.core.builder
    real_apply = builder.apply

    def apply(events):
        if any(isinstance(ev, Acquire) and ev.seed == POISON_SEED for ev in events):
            raise OverflowError("injected: a setting the step's arrays cannot hold")
        real_apply(events)

    expected = {}
    _steady(server, expected)
    free = server.free_pages()
    monkeypatch.setattr(builder, "apply", apply)
    got: dict = {}
    t = threading.Thread(target=_steady, args=(server, got))
    t.start()
    with client(server) as c:
        poisoned = {"prompt": "poison", "max_tokens": 5, "seed": POISON_SEED}
        r = c.post("/v1/completions", json=poisoned)
        with c.stream("POST", "/generate", json=poisoned | {"stream": True}) as s:
            lines = [json.loads(line) for line in s.iter_lines() if line]
    t.join(60)
    assert r.status_code == 500 and r.json()["error"]["code"] == "request_failed"
    assert "injected" in r.json()["error"]["message"]
    assert lines[-1]["error"]["code"] == "request_failed"
    assert got["tokens"] == expected["tokens"]
    assert server.engine.is_healthy
    server.wait_idle()
    assert server.free_pages() == free
    failed = server.engine.get_metrics()["nori:request_success_total"]["error"]
    assert failed == 2


def test_a_request_whose_outputs_fail_to_process_fails_alone(server: Server, monkeypatch) -> None:
    real_cut = OutputProcessor._cut_at_stop_string

    def cut(s):
        if "boom" in s.params.stop:
            raise UnicodeError("injected: this request's text cannot be handled")
        return real_cut(s)

    expected = {}
    _steady(server, expected)
    monkeypatch.setattr(OutputProcessor, "_cut_at_stop_string", staticmethod(cut))
    got: dict = {}
    t = threading.Thread(target=_steady, args=(server, got))
    t.start()
    with client(server) as c:
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 8, "stop": "boom"})
    t.join(60)
    assert r.status_code == 500 and r.json()["error"]["code"] == "request_failed"
    assert "injected" in r.json()["error"]["message"]
    assert got["tokens"] == expected["tokens"]
    assert server.engine.is_healthy


def test_engine_death_fails_every_request_in_flight(server: Server, slow_steps) -> None:
    body = {"prompt": "doomed", "max_tokens": 200, "ignore_eos": True}
    results: dict[str, object] = {}

    def whole(name: str, path: str, extra: dict) -> None:
        with client(server) as c:
            results[name] = c.post(path, json=_without_none(body | extra))

    def streamed(name: str, path: str, extra: dict) -> None:
        with client(server) as c:
            with c.stream("POST", path, json=_without_none(body | extra | {"stream": True})) as r:
                results[name] = (r.status_code, [line for line in r.iter_lines() if line])

    chat = {"prompt": None, "messages": [{"role": "user", "content": "doomed"}], "max_tokens": 150}
    jobs = [
        threading.Thread(target=whole, args=("completion", "/v1/completions", {})),
        threading.Thread(target=whole, args=("chat", "/v1/chat/completions", chat)),
        threading.Thread(target=whole, args=("generate", "/generate", {})),
        threading.Thread(target=streamed, args=("completion-stream", "/v1/completions", {})),
        threading.Thread(target=streamed, args=("chat-stream", "/v1/chat/completions", chat)),
        threading.Thread(target=streamed, args=("generate-stream", "/generate", {})),
    ]
    for t in jobs:
        t.start()
    deadline = time.monotonic() + 30
    while server.engine.num_in_flight < len(jobs):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.2)  # a few tokens out

    def broken_launch(plan):
        raise RuntimeError("injected device failure")

    server.llm_engine.runner.launch = broken_launch
    for t in jobs:
        t.join(30)
        assert not t.is_alive()

    for name in ("completion", "chat", "generate"):
        r = results[name]
        assert r.status_code == 500, name
        err = r.json()["error"]
        assert err["code"] == "engine_dead" and "injected device failure" in err["message"]
    for name in ("completion-stream", "chat-stream"):
        status, lines = results[name]
        assert status == 200  # the headers went out before the engine died
        assert lines[-1] == "data: [DONE]"
        err = json.loads(lines[-2][len("data: ") :])["error"]
        assert err["code"] == "engine_dead", name
    status, lines = results["generate-stream"]
    assert json.loads(lines[-1])["error"]["code"] == "engine_dead"

    health = httpx.get(f"{server.url}/health")
    assert health.status_code == 503
    assert "injected device failure" in health.json()["reason"]
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "after", "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
    assert server.engine.num_in_flight == 0


def _without_none(body: dict) -> dict:
    return {k: v for k, v in body.items() if v is not None}
