"""The server over the engine core in its own process (what `nori-jax serve` runs).

Same greedy tokens as the in-process engine; outputs streamed across the process boundary; and
when the engine-core process dies, every request in flight ends with a JSON error and /health
turns 503.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest
from openai import OpenAI
from serve_harness import MODEL_NAME, Server, client, engine_config, running_server

from nori_jax import LLM, SamplingParams
from nori_jax.core_client import EngineCoreClient

PROMPTS = [[5, 6, 7], [40, 41, 42, 43, 44, 45], list(range(100, 160))]
GREEDY = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server():
    with running_server(engine=EngineCoreClient(engine_config())) as s:
        yield s


def test_greedy_tokens_match_the_in_process_engine(server: Server) -> None:
    llm = LLM.from_config(engine_config())
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in llm.generate(PROMPTS, params)]
    with client(server) as c:
        got = [
            c.post("/generate", json={"prompt": p, **GREEDY}).json()["token_ids"] for p in PROMPTS
        ]
    assert got == expected


def test_streams_through_the_openai_client(server: Server) -> None:
    oa = OpenAI(base_url=f"{server.url}/v1", api_key="none")
    chunks = list(
        oa.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=10,
            temperature=0,
            stream=True,
        )
    )
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    whole = oa.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=10, temperature=0
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == whole.choices[0].message.content
    metrics = httpx.get(f"{server.url}/metrics").text
    assert "nori:generation_tokens_total" in metrics and "nori:recompiles_total 0.0" in metrics
    assert 'nori:model_config_info{dtype="float32",quantization="none"' in metrics  # from the core


def test_engine_process_death_fails_every_request_in_flight(server: Server) -> None:
    body = {"prompt": "doomed", "max_tokens": 240, "ignore_eos": True}
    results: dict[str, object] = {}

    def whole(name: str) -> None:
        with client(server) as c:
            results[name] = c.post("/v1/completions", json=body)

    started = [threading.Event() for _ in range(2)]

    def streamed(name: str, first_chunk: threading.Event) -> None:
        with client(server) as c:
            with c.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
                lines = []
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                        first_chunk.set()
                results[name] = (r.status_code, lines)

    jobs = [threading.Thread(target=whole, args=(f"whole{i}",)) for i in range(2)]
    jobs += [threading.Thread(target=streamed, args=(f"stream{i}", started[i])) for i in range(2)]
    for t in jobs:
        t.start()
    deadline = time.monotonic() + 30
    while server.engine.num_in_flight < len(jobs) or not all(e.is_set() for e in started):
        assert time.monotonic() < deadline
        time.sleep(0.005)
    os.kill(server.engine.pid, signal.SIGKILL)
    for t in jobs:
        t.join(30)
        assert not t.is_alive()
    for i in range(2):
        r = results[f"whole{i}"]
        assert r.status_code == 500 and r.json()["error"]["code"] == "engine_dead"
        status, lines = results[f"stream{i}"]
        assert status == 200 and lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][len("data: ") :])["error"]["code"] == "engine_dead"
    health = httpx.get(f"{server.url}/health")
    assert health.status_code == 503 and "exited" in health.json()["reason"]
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "after", "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
    assert server.engine.num_in_flight == 0
