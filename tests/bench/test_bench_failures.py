"""Servers that error, break streams or hang yield failed requests with reasons; runs always end."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
from bench_helpers import FakeServer, run_bench

from nori_jax.bench.http1 import HttpClient, _Connection
from nori_jax.bench.stream_request import _Stream


def test_http_errors_are_failed_requests_with_the_status_and_message(server: FakeServer) -> None:
    server.set(fail_every=3, fail_status=503)
    run = run_bench(server, dataset={"num_prompts": 12})
    failed = [r for r in run.results if not r.success]
    assert len(failed) == 4 and run.metrics.completed == 8 and run.metrics.failed == 4
    assert {r.error for r in failed} == {"HTTP 503: fake overload"}
    assert {r.http_status for r in failed} == {503}
    assert run.metrics.total_input == 8 * 32  # only successful requests count


def test_broken_streams_fail_with_a_reason(server: FakeServer) -> None:
    server.set(break_every=2, itl_s=0.002)
    run = run_bench(server, dataset={"num_prompts": 10})
    failed = [r for r in run.results if not r.success]
    assert len(failed) == 5
    assert all("closed by the server mid-response" in r.error for r in failed), failed[0].error
    assert all(r.output_tokens <= 2 for r in failed)


def test_hanging_server_times_out_and_the_run_ends(server: FakeServer) -> None:
    server.set(hang_every=2)
    start = time.monotonic()
    run = run_bench(server, dataset={"num_prompts": 8}, client={"request_timeout_s": 0.5})
    assert time.monotonic() - start < 10
    failed = [r for r in run.results if not r.success]
    assert len(failed) == 4 and run.metrics.completed == 4
    assert all(r.error.startswith("timeout after 0.5 s") for r in failed)


def test_hanging_server_with_worker_processes_also_ends(server: FakeServer) -> None:
    server.set(hang_every=3)
    run = run_bench(
        server,
        dataset={"num_prompts": 9},
        client={"request_timeout_s": 0.5, "num_processes": 2},
    )
    assert run.metrics.failed == 3 and run.metrics.completed == 6
    assert run.health.num_processes == 2


def test_no_server_fails_every_request_and_says_so() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    class Nowhere:
        base_url = f"http://127.0.0.1:{port}"

    run = run_bench(Nowhere(), dataset={"num_prompts": 5})  # type: ignore[arg-type]
    assert run.metrics.completed == 0 and run.metrics.failed == 5
    assert all("ConnectionRefusedError" in r.error for r in run.results)
    assert any("every request failed" in w for w in run.warnings)


def test_outputs_shorter_than_max_tokens_are_flagged_with_ignore_eos(server: FakeServer) -> None:
    server.set(max_output=3)
    run = run_bench(server, client={"ignore_eos": True})
    assert any("fewer tokens than max_tokens" in w for w in run.warnings)


def _stream(events: list[bytes], chunking: int | None = None) -> _Stream:
    s = _Stream("completions", 0.0)
    s.on_head(200)
    data = b"".join(events)
    step = chunking or len(data)
    for i in range(0, len(data), step):
        s.on_body(data[i : i + step], 1.0 + i)
    s.finish(99.0)
    return s


TOK = b'data: {"choices":[{"index":0,"text":"x","finish_reason":null}]}\n\n'
USAGE = b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}\n\n'


@pytest.mark.parametrize("chunking", [None, 1, 7])
def test_sse_parsing_is_independent_of_how_bytes_arrive(chunking: int | None) -> None:
    s = _stream([b": ping\n\n", TOK, TOK, USAGE, b"data: [DONE]\n\n"], chunking)
    assert s.error is None and len(s.times) == 2 and s.usage_tokens == 2 and s.prompt_tokens == 3


@pytest.mark.parametrize(
    ("events", "reason"),
    [
        ([TOK, b'data: {"error": {"message": "engine died"}}\n\n'], "engine died"),
        ([TOK, b"data: {not json\n\n"], "malformed stream event"),
        ([TOK], "stream closed before the end"),
        ([USAGE, b"data: [DONE]\n\n"], "without any generated text"),
    ],
)
def test_bad_streams_fail_with_their_reason(events: list[bytes], reason: str) -> None:
    s = _stream(events)
    assert s.error is not None and reason in s.error


def test_error_status_reason_uses_the_body_message() -> None:
    s = _Stream("chat", 0.0)
    s.on_head(400)
    s.on_body(b'{"object":"error","message":"max_tokens is too large","code":400}', 1.0)
    s.finish(2.0)
    assert s.error == "HTTP 400: max_tokens is too large"


class _Sink:
    def __init__(self) -> None:
        self.status: int | None = None
        self.body = b""

    def on_head(self, status: int) -> None:
        self.status = status

    def on_body(self, data: bytes, now: float) -> None:
        self.body += data


@pytest.mark.parametrize("step", [1, 3, 1000])
@pytest.mark.parametrize(
    ("response", "body"),
    [
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nX-Trailer: y\r\n\r\n",
            b"hello world",
        ),
        (
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\ncontent-length: 3\r\n\r\nabc",
            b"abc",
        ),
    ],
)
def test_http_framing_survives_any_split(response: bytes, body: bytes, step: int) -> None:
    async def main() -> None:
        conn = _Connection()

        class _Transport:
            def write(self, data: bytes) -> None:
                pass

            def abort(self) -> None:
                pass

        conn.connection_made(_Transport())  # type: ignore[arg-type]
        sink = _Sink()
        done = conn.exchange(b"POST / HTTP/1.1\r\n\r\n", sink)
        for i in range(0, len(response), step):
            conn.data_received(response[i : i + step])
        await asyncio.wait_for(done, 1.0)
        assert sink.body == body and sink.status in (200, 201) and conn.keep_alive

    asyncio.run(main())


def test_stale_keep_alive_connection_is_retried(server: FakeServer) -> None:
    """A pooled connection the server closes as the request goes out is retried on a new one."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        stale = _Connection()

        class _ClosingTransport:  # the server's keep-alive timeout fired as we reused it
            def write(self, data: bytes) -> None:
                loop.call_soon(stale.connection_lost, None)

            def is_closing(self) -> bool:
                return False

            def abort(self) -> None:
                pass

        stale.connection_made(_ClosingTransport())  # type: ignore[arg-type]
        client = HttpClient(server.base_url + "/v1/completions", {})
        client._idle.append(stale)
        stream = _Stream("completions", 0.0)
        await client.post(b'{"prompt": "a", "max_tokens": 2}', stream)
        stream.finish(0.0)
        assert stream.error is None and len(stream.times) == 2
        assert client._idle and client._idle[0] is not stale
        client.close()

    asyncio.run(main())
