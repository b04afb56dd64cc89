"""A server whose engine runs the priority policy (`--scheduling-policy priority`): requests
carry vLLM's `priority` field on every route, and answers are the ones priority 0 gets."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from serve_harness import MODEL_NAME, Server, running_server


@pytest.fixture(scope="module")
def server():
    with running_server(scheduling_policy="priority") as s:
        yield s


def test_priorities_are_taken_and_change_no_answer(server: Server) -> None:
    oai = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    base = oai.completions.create(model=MODEL_NAME, prompt=[5, 6, 7], max_tokens=6, temperature=0)

    async def many() -> list[str]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            bodies = [
                {"prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0, "priority": p}
                for p in (7, -5, 0, 2**31 - 1, -(2**31))
            ]
            answers = await asyncio.gather(*(c.post("/v1/completions", json=b) for b in bodies))
        return [a.json()["choices"][0]["text"] for a in answers]

    assert asyncio.run(many()) == [base.choices[0].text] * 5
    chat = oai.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        extra_body={"priority": -1},
    )
    assert chat.choices[0].finish_reason in ("stop", "length")
    with httpx.Client(base_url=server.url, timeout=60) as c:
        r = c.post("/generate", json={"prompt": "hi", "max_tokens": 2, "priority": 3})
    assert r.status_code == 200, r.text
