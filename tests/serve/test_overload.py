"""Backpressure: past the waiting-queue bound a request gets 429 + Retry-After at once, and every
request that was accepted still completes in full."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from serve_harness import Server, running_server

NUM_REQUESTS = 64
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def server():
    with running_server({"retry_after_s": 3}, max_num_waiting=4) as s:
        yield s


async def _burst(server: Server) -> list[tuple[int, dict, list[dict]]]:
    limits = httpx.Limits(max_connections=NUM_REQUESTS)
    async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as http:

        async def one(i: int) -> tuple[int, dict, list[dict]]:
            body = {
                "prompt": f"load {i} " + "x" * (i % 40),
                "max_tokens": MAX_TOKENS,
                "ignore_eos": True,
                "stream": i % 2 == 0,
            }
            async with http.stream("POST", "/generate", json=body) as r:
                raw = await r.aread()
                if r.status_code != 200:
                    return r.status_code, dict(r.headers), [json.loads(raw)]
                return 200, dict(r.headers), [json.loads(x) for x in raw.splitlines() if x]

        return await asyncio.gather(*(one(i) for i in range(NUM_REQUESTS)))


def test_overload_gives_429_and_loses_nothing_accepted(server: Server) -> None:
    before = server.engine.get_metrics()["nori:request_success_total"]
    results = asyncio.run(_burst(server))
    statuses = [status for status, _, _ in results]
    assert set(statuses) <= {200, 429}
    rejected = [(h, events[0]) for status, h, events in results if status == 429]
    accepted = [events for status, _, events in results if status == 200]
    assert rejected, "the burst never filled the waiting queue"
    assert len(accepted) >= 4  # at least a full waiting queue got in
    for headers, body in rejected:
        assert headers["retry-after"] == "3"
        assert body["error"]["code"] == "queue_full" and body["error"]["type"] == "rate_limit_error"
    for events in accepted:
        final = events[-1]
        assert final["finish_reason"] == "length"
        assert final["usage"]["completion_tokens"] == MAX_TOKENS
        if len(events) > 1:  # streamed: every token arrived
            assert sum(len(e["token_ids"]) for e in events) == MAX_TOKENS
    server.wait_idle()
    after = server.engine.get_metrics()["nori:request_success_total"]
    assert after["length"] - before["length"] == len(accepted)
    assert after["abort"] == before["abort"]
    assert server.engine.is_healthy


def test_n_choices_past_the_queue_bound_are_all_withdrawn(server: Server) -> None:
    """A request whose choices do not all fit the waiting queue gets 429, and the choices that
    were already queued are aborted: none runs on for nobody."""
    server.wait_idle()
    before = server.engine.get_metrics()["nori:request_success_total"]
    with httpx.Client(base_url=server.url, timeout=60) as http:
        body = {"prompt": "many choices", "max_tokens": 200, "ignore_eos": True, "n": 64}
        r = http.post("/v1/completions", json=body)  # 64 > 16 running + 4 waiting
    assert r.status_code == 429, r.text
    assert r.json()["error"]["code"] == "queue_full"
    server.wait_idle()
    after = server.engine.get_metrics()["nori:request_success_total"]
    done = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert done.get("length", 0) == 0  # a choice left running would have reached its length
    assert done.get("abort", 0) >= 4  # at least a full waiting queue's worth was withdrawn
