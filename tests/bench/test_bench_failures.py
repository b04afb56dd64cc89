"""Servers that error, break streams or hang yield failed requests with reasons; runs always end."""

from __future__ import annotations

import socket
import time

import pytest
from bench_helpers import FakeServer, run_bench

from nori_jax.bench.client import RequestResult, SseStream


def test_http_errors_are_failed_requests_with_the_status_and_message(server: FakeServer) -> None:
    server.set(fail_every=3, fail_status=503)
    run = run_bench(server, {"num_prompts": 12})
    failed = [r for r in run.results if not r.success]
    assert len(failed) == 4 and run.metrics["completed"] == 8 and run.metrics["failed"] == 4
    assert {r.error for r in failed} == {"HTTP 503: fake overload"}
    assert {r.http_status for r in failed} == {503}
    assert run.metrics["total_input_tokens"] == 8 * 32  # only successful requests count
    assert any("4 of 12 requests failed: the latency figures are over the successful" in w
               for w in run.warnings), run.warnings  # fmt: skip


def test_streams_that_batch_tokens_into_chunks_are_flagged(server: FakeServer) -> None:
    """Timing is per chunk: where chunks carry several tokens, TTFT, ITL and TPOT blur."""
    server.set(tokens_per_chunk=4)
    run = run_bench(server, {"num_prompts": 4})
    assert any("chunks carried 4.0 tokens each" in w for w in run.warnings), run.warnings
    server.set(tokens_per_chunk=1)
    assert not any("chunks carried" in w for w in run_bench(server, {"num_prompts": 4}).warnings)


def test_broken_streams_fail_with_a_reason(server: FakeServer) -> None:
    server.set(break_every=2, itl_s=0.002)
    run = run_bench(server, {"num_prompts": 10})
    failed = [r for r in run.results if not r.success]
    assert len(failed) == 5
    assert all("closed by the server mid-response" in r.error for r in failed), failed[0].error
    assert all(r.output_tokens <= 2 for r in failed)


@pytest.mark.parametrize("processes", [1, 2])
def test_hanging_server_times_out_and_the_run_ends(server: FakeServer, processes: int) -> None:
    server.set(hang_every=2)
    start = time.monotonic()
    run = run_bench(server, {"num_prompts": 8}, request_timeout_s=0.5, num_processes=processes)
    assert time.monotonic() - start < 15
    failed = [r for r in run.results if not r.success]
    assert len(failed) == 4 and run.metrics["completed"] == 4
    assert all(r.error.startswith("timeout after 0.5 s") for r in failed)
    assert run.health["client_processes"] == processes


def test_no_server_fails_every_request_and_says_so() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    class Nowhere:
        base_url = f"http://127.0.0.1:{port}"

    run = run_bench(Nowhere(), {"num_prompts": 5})  # type: ignore[arg-type]
    assert run.metrics["completed"] == 0 and run.metrics["failed"] == 5
    assert all("Cannot connect to host" in r.error for r in run.results), run.results[0].error
    assert any("every request failed" in w for w in run.warnings)


def test_outputs_shorter_than_max_tokens_are_flagged_with_ignore_eos(server: FakeServer) -> None:
    server.set(max_output=3)
    run = run_bench(server, ignore_eos=True)
    assert any("fewer tokens than max_tokens" in w for w in run.warnings)


def _stream(events: list[bytes], chunking: int | None = None) -> SseStream:
    s = SseStream(False, 0.0)
    data = b"".join(events)
    step = chunking or len(data)
    for i in range(0, len(data), step):
        if s.feed(data[i : i + step], 1.0 + i):
            break
    s.finish()
    return s


TOK = b'data: {"choices":[{"index":0,"text":"x","finish_reason":null}]}\n\n'
USAGE = b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}\n\n'


@pytest.mark.parametrize("chunking", [None, 1, 7])
def test_sse_parsing_is_independent_of_how_bytes_arrive(chunking: int | None) -> None:
    s = _stream([b": ping\n\n", TOK, TOK, USAGE, b"data: [DONE]\n\n"], chunking)
    assert s.error is None and len(s.times) == 2 and s.usage_tokens == 2 and s.prompt_tokens == 3
    r = RequestResult(0, 0.0)
    s.fill(r, 99.0)
    assert r.success and r.output_tokens == 2 and r.output_tokens_from_usage
    assert r.ttft_s == s.times[0] and r.latency_s == s.times[1] and r.generated_text == "xx"


@pytest.mark.parametrize(
    ("events", "reason"),
    [
        ([TOK, b'data: {"error": {"message": "engine died"}}\n\n'], "engine died"),
        ([TOK, b"data: {not json\n\n"], "malformed stream event"),
        ([TOK], "stream closed before the end"),
        ([USAGE, b"data: [DONE]\n\n"], "without any generated text (usage: 2 tokens)"),
    ],
)
def test_bad_streams_fail_with_their_reason(events: list[bytes], reason: str) -> None:
    s = _stream(events)
    assert s.error is not None and reason in s.error


def test_error_status_reason_uses_the_body_message() -> None:
    from nori_jax.bench.client import error_from_body

    body = b'{"object":"error","message":"max_tokens is too large","code":400}'
    assert error_from_body(400, body) == "HTTP 400: max_tokens is too large"
    assert error_from_body(502, b"<html>bad gateway</html>") == "HTTP 502: <html>bad gateway</html>"
    assert error_from_body(500, b"") == "HTTP 500"
