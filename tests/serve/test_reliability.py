"""The reliability suite's short versions (benchmarks/reliability/ has the long ones): a soak of a
few seconds that loses nothing, and a storm of client disconnects that leaves no page in use."""

from __future__ import annotations

import asyncio
import importlib
import pathlib
import sys

import httpx
import pytest
from serve_harness import Server, running_server

SCRIPTS = pathlib.Path(__file__).parents[2] / "benchmarks" / "reliability"


def _script(name: str):
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))  # as when run: the scripts import each other
    return importlib.import_module(name)


@pytest.fixture(scope="module")
def server():
    with running_server() as s:
        yield s


def test_short_soak_loses_nothing(server: Server, capsys) -> None:
    soak = _script("soak")
    # Lengths that fit the tiny model's 256 positions; a Poisson load for 6 s.
    code = soak.main(
        ["--url", server.url, "--rate", "10", "--duration", "6", "--interval", "3"]
        + ["--vocab", "512", "--input-mu", "3.5", "--max-input", "100"]
        + ["--output-mu", "3", "--max-output", "100"]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "[FAIL]" not in out and "0 failed" in out


def test_disconnect_storm_frees_every_page(server: Server) -> None:
    server.wait_idle()
    free, aborted = server.free_pages(), server.engine.get_metrics()
    aborted = aborted["nori:request_success_total"]["abort"]
    body = {"prompt": "storm", "max_tokens": 200, "ignore_eos": True, "stream": True}
    n = 24

    async def storm() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:

            async def leave(i: int) -> None:
                async with http.stream("POST", "/generate", json=body) as r:
                    seen = 0
                    async for _ in r.aiter_lines():
                        seen += 1
                        if seen > i % 4:
                            return  # closes the connection mid-stream

            await asyncio.gather(*(leave(i) for i in range(n)))

    asyncio.run(storm())
    server.wait_idle()
    assert server.free_pages() == free
    after = server.engine.get_metrics()["nori:request_success_total"]["abort"]
    assert after - aborted == n
    assert server.engine.is_healthy
    assert httpx.post(f"{server.url}/generate", json={"prompt": "x", "max_tokens": 2}).is_success
