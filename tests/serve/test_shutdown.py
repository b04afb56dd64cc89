"""SIGTERM with requests that outlast the drain timeout: while draining the server answers
/health and new work with 503 JSON; afterwards every request still in flight ends with a JSON
error (whole: a 503 body; SSE: an error event, then [DONE]; NDJSON: an error line), nothing cut
mid-chunk, and the server exits."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest
from serve_harness import Server, client, running_server

LONG = {"max_tokens": 200, "ignore_eos": True}


@pytest.fixture(scope="module")
def server():
    with running_server({"drain_timeout_s": 0.5}) as s:
        yield s


def test_sigterm_past_the_drain_timeout_ends_every_request_with_json(
    server: Server, slow_steps
) -> None:
    results: dict[str, object] = {}

    def whole() -> None:
        with client(server) as c:
            results["whole"] = c.post("/v1/completions", json={"prompt": "long"} | LONG)

    def streamed(name: str, path: str, body: dict) -> None:
        with client(server) as c:
            with c.stream("POST", path, json=body | LONG | {"stream": True}) as r:
                # splitlines(): every event must stay one line for line-based readers.
                results[name] = (r.status_code, r.read().decode().splitlines())

    chat = {"messages": [{"role": "user", "content": "long"}]}
    jobs = [
        threading.Thread(target=whole),
        threading.Thread(target=streamed, args=("sse", "/v1/completions", {"prompt": "l"})),
        threading.Thread(target=streamed, args=("chat", "/v1/chat/completions", chat)),
        threading.Thread(target=streamed, args=("ndjson", "/generate", {"prompt": "l"})),
    ]
    for t in jobs:
        t.start()
    deadline = time.monotonic() + 30
    while server.engine.num_in_flight < len(jobs):
        assert time.monotonic() < deadline
        time.sleep(0.01)

    server.uvicorn.handle_exit(signal.SIGTERM, None)  # what uvicorn's signal handler calls
    time.sleep(0.1)
    health = httpx.get(f"{server.url}/health", timeout=5)
    assert health.status_code == 503 and health.json()["status"] == "unhealthy"
    late = httpx.post(f"{server.url}/generate", json={"prompt": "late", "max_tokens": 2})
    assert late.status_code == 503 and late.json()["error"]["code"] == "engine_unavailable"
    for t in jobs:
        t.join(30)
        assert not t.is_alive()

    r = results["whole"]
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
    for name in ("sse", "chat"):
        status, lines = results[name]
        events = [line[len("data: ") :] for line in lines if line]
        assert status == 200 and events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "engine_unavailable"
        assert all(json.loads(e) for e in events[:-1])  # every event whole
    status, lines = results["ndjson"]
    parsed = [json.loads(line) for line in lines if line]
    assert status == 200 and parsed[-1]["error"]["code"] == "engine_unavailable"
    assert all("token_ids" in x for x in parsed[:-1])
    server.thread.join(30)
    assert not server.thread.is_alive(), "the server did not exit after the drain"
