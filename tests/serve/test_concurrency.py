"""Many clients at once: batching changes no greedy token; a client that leaves frees its pages."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from serve_harness import MODEL_NAME, Server, client, running_server

NUM_STREAMS = 32
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def server():
    with running_server() as s:
        yield s


def prompts() -> list[str]:
    # Different lengths, so prefill chunks of different sizes share steps with decodes.
    return [f"request {i}: " + "lorem ipsum " * (i % 5) for i in range(NUM_STREAMS)]


async def _concurrent(server: Server) -> list[tuple[list[int] | None, str]]:
    """Half the streams through /generate (token ids), half through the openai client (text)."""
    oai = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    limits = httpx.Limits(max_connections=NUM_STREAMS)
    async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as http:

        async def ndjson_stream(prompt: str) -> tuple[list[int] | None, str]:
            body = {
                "prompt": prompt,
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
            ids, text = [], ""
            async with http.stream("POST", "/generate", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line:
                        event = json.loads(line)
                        ids += event["token_ids"]
                        text += event["text"]
            return ids, text

        async def openai_stream(prompt: str) -> tuple[list[int] | None, str]:
            stream = await oai.completions.create(
                model=MODEL_NAME,
                prompt=prompt,
                max_tokens=MAX_TOKENS,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            return None, "".join([c.choices[0].text async for c in stream])

        jobs = [
            ndjson_stream(p) if i % 2 == 0 else openai_stream(p) for i, p in enumerate(prompts())
        ]
        results = await asyncio.gather(*jobs)
    await oai.close()
    return results


def test_concurrent_streams_match_sequential(server: Server) -> None:
    with client(server) as c:
        sequential = []
        for p in prompts():
            r = c.post(
                "/generate",
                json={"prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True},
            )
            sequential.append((r.json()["token_ids"], r.json()["text"]))
    server.wait_idle()
    steps_before = _steps(server)
    together = asyncio.run(_concurrent(server))
    # They did share steps: run one by one they would take 32 x 16 of them.
    assert _steps(server) - steps_before < NUM_STREAMS * MAX_TOKENS / 4
    for i, ((ids, text), (want_ids, want_text)) in enumerate(
        zip(together, sequential, strict=True)
    ):
        assert len(want_ids) == MAX_TOKENS
        if ids is not None:
            assert ids == want_ids, f"stream {i}"
        assert text == want_text, f"stream {i}"
    server.wait_idle()
    assert server.llm_engine.num_recompiles == 0


def _steps(server: Server) -> float:
    return server.engine.get_metrics()["nori:step_duration_seconds"]["count"]


def _aborted(server: Server) -> float:
    return server.engine.get_metrics()["nori:request_success_total"]["abort"]


def _wait_pages(server: Server, want: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while server.free_pages() != want or server.engine.num_in_flight:
        assert time.monotonic() < deadline, f"{server.free_pages()} free pages, want {want}"
        time.sleep(0.01)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/generate"])
def test_disconnect_mid_stream_frees_pages(server: Server, slow_steps, path: str) -> None:
    server.wait_idle()
    start_free, aborted = server.free_pages(), _aborted(server)
    body = {"max_tokens": 150, "ignore_eos": True, "stream": True}
    if path == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": "go on " * 5}]
    else:
        body["prompt"] = "go on " * 5
    with client(server) as c:
        with c.stream("POST", path, json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for _ in range(6):
                next(lines)
            # Tokens are flowing: pages are in use.
            assert server.free_pages() < start_free
        # Leaving the block closed the connection mid-stream.
    _wait_pages(server, start_free)
    assert (
        server.llm_engine.scheduler.running == []
        and not server.llm_engine.has_unfinished_requests()
    )
    server.wait_idle()
    assert _aborted(server) == aborted + 1


def test_disconnect_while_waiting_for_a_whole_response(server: Server, slow_steps) -> None:
    server.wait_idle()
    start_free, aborted = server.free_pages(), _aborted(server)
    body = {"prompt": "never read", "max_tokens": 200, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=0.5)
    _wait_pages(server, start_free)
    server.wait_idle()
    assert _aborted(server) == aborted + 1
