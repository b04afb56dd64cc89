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
    assert r.success and r.output_tokens == 2 and r.output_tokens_source == "usage"
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


def test_a_malformed_event_fails_only_its_request(server: FakeServer) -> None:
    """A `"text": 7` event: that request fails with the reason, its process's others succeed."""
    server.set(bad_text_every=3)
    run = run_bench(server, {"num_prompts": 6}, num_processes=1)
    failed = [r for r in run.results if not r.success]
    assert len(failed) == 2 and run.metrics["completed"] == 4
    assert all(r.error.startswith("malformed stream event") for r in failed), failed[0].error


def test_a_crashed_client_process_reports_the_innermost_exception() -> None:
    from nori_jax.bench.workers import crash_reason

    inner = TypeError("sequence item 0: expected str instance, int found")
    nested = ExceptionGroup("unhandled errors in a TaskGroup", [ExceptionGroup("g", [inner])])
    assert crash_reason(nested) == "TypeError: sequence item 0: expected str instance, int found"
    assert crash_reason(ValueError("plain")) == "ValueError: plain"


def test_the_listening_thread_ends_quietly_once_the_loop_is_closed() -> None:
    """The parent closes a worker's stdin after its result: the thread then sees EOF, with the
    event loop already closed, and must end without 'RuntimeError: Event loop is closed'."""
    import asyncio
    import io

    from nori_jax.bench import workers

    loop = asyncio.new_event_loop()
    loop.close()
    workers.listen(io.BytesIO(b""), loop, lambda msg: None)  # returns, raises nothing


@pytest.mark.parametrize("completion_tokens", ["8", -5, [8], True, 7.5])
def test_usage_counts_that_are_no_counts_are_ignored_with_a_warning(
    server: FakeServer, completion_tokens: object
) -> None:
    server.set(completion_tokens=completion_tokens)
    run = run_bench(server, {"num_prompts": 4})
    assert run.metrics["completed"] == 4
    assert all(r.output_tokens == 8 and r.output_tokens_source == "chunks" for r in run.results)
    assert run.metrics["total_output_tokens"] == 32
    assert any("4 requests had a usage block whose counts are not integers >= 0" in w
               for w in run.warnings), run.warnings  # fmt: skip


def test_usage_below_the_chunks_sent_is_replaced_by_the_chunk_count(server: FakeServer) -> None:
    server.set(completion_tokens=1)  # eight text chunks, "one token"
    run = run_bench(server, {"num_prompts": 4})
    assert all(r.output_tokens == 8 and r.usage_below_chunks for r in run.results)
    assert run.metrics["mean_tpot_ms"] > 0  # the TPOT samples are there
    assert any("the server's usage is lower than the chunks it sent for 4 requests" in w
               for w in run.warnings), run.warnings  # fmt: skip


@pytest.mark.timeout(60)
def test_an_infinite_request_timeout_is_no_timeout(server: FakeServer) -> None:
    import math

    run = run_bench(server, {"num_prompts": 4}, request_timeout_s=math.inf)
    assert run.metrics["completed"] == 4


@pytest.mark.timeout(60)
def test_reading_stops_at_done_when_the_server_keeps_the_connection_open(
    server: FakeServer,
) -> None:
    server.set(open_after_done=True)
    run = run_bench(server, {"num_prompts": 4}, request_timeout_s=1.0)
    assert run.metrics["completed"] == 4, run.results[0].error


def test_a_200_answer_that_is_no_event_stream_quotes_its_content_type_and_body(
    server: FakeServer,
) -> None:
    server.set(plain_json=True)
    run = run_bench(server, {"num_prompts": 2})
    assert run.metrics["failed"] == 2
    error = run.results[0].error
    assert "not an event stream" in error and "application/json" in error, error
    assert '{"choices":[{"index":0,"text":" t0' in error, error


def test_a_non_string_text_is_a_malformed_event_and_fills_cleanly() -> None:
    s = _stream([TOK, b'data: {"choices":[{"index":0,"text":7}]}\n\n', USAGE, b"data: [DONE]\n\n"])
    assert s.error is not None and s.error.startswith("malformed stream event")
    r = RequestResult(0, 0.0)
    s.fill(r, 5.0)  # raises nothing
    assert not r.success and r.generated_text == "x"


def test_one_huge_event_in_many_reads_is_parsed_whole() -> None:
    """A 4 MB event in 4 KB reads: only the newest read is searched for its end, so the pieces
    are joined once (not once per read, which is quadratic)."""
    text = "x" * (4 << 20)
    event = (
        b'data: {"choices":[{"index":0,"text":"'
        + text.encode()
        + b'","finish_reason":"length"}]}\n\n'
    )
    s = _stream([event, b"data: [DONE]\n\n"], chunking=4096)
    assert s.error is None and s.text == [text] and s.finish_reason == "length"
