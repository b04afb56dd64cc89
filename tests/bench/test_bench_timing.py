"""Measured TTFT, TPOT, ITL, E2E and their percentiles match what the fake server injects.

Per-request tolerances are a few milliseconds (every measured latency also holds a localhost
round trip and the fake server's own handling). Percentiles get a relative tolerance on top: the
client and the server share a small, possibly busy CI machine, where one descheduling of either
process moves the P99 of a few dozen requests by tens of milliseconds.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from bench_helpers import FakeServer, run_bench

from nori_jax.bench.workload import LognormalLengths

TTFT_S, PER_TOKEN_S, ITL_S = 0.020, 0.0002, 0.006


def test_latencies_match_injected_delays(server: FakeServer) -> None:
    # TTFT grows with the prompt like a prefill: 20 ms + 0.2 ms per prompt token (30-420 ms)
    server.set(ttft_s=TTFT_S, ttft_per_prompt_token_s=PER_TOKEN_S, itl_s=ITL_S)
    run = run_bench(
        server,
        {
            "dataset": "lognormal",
            "num_prompts": 48,
            "input_lengths": LognormalLengths(6.2, 0.8, 50, 2000),
            "output_lengths": LognormalLengths(2.5, 0.5, 6, 30),
            # Poisson arrivals keep the single-process fake server from queueing requests (which
            # would be true TTFT, but not the injected one); warm-up opens the connections
            "request_rate": 40.0,
            "warmup_requests": 8,
        },
        metric_percentiles=(50.0, 90.0, 99.0),
    )
    m, rs = run.metrics, run.results
    assert m["completed"] == 48 and m["failed"] == 0
    # what the server did: its planned delays, and when it actually yielded each token
    sent = server.stats()["sent"][8:]
    planned = np.array([TTFT_S + PER_TOKEN_S * r.server_prompt_tokens for r in rs])
    actual = np.array([s["ttft_s"] for s in sent])
    measured = np.array([r.ttft_s for r in rs])
    assert np.median(np.abs(np.sort(actual) - np.sort(planned))) < 0.005  # the fake is sane
    # The client sees what the server did, plus a localhost round trip, give or take its own
    # event-loop lag, which it measures and reports (a busy CI machine makes that milliseconds).
    slack_s = 0.005 + run.health["client_loop_lag_p99_ms"] / 1e3
    assert np.median(np.sort(measured) - np.sort(actual)) == pytest.approx(0.0, abs=slack_s)
    for p in (50, 90, 99):
        got = m[f"p{p}_ttft_ms"]
        assert got == pytest.approx(np.percentile(measured, p) * 1e3)  # the arithmetic
        assert got == pytest.approx(np.percentile(actual, p) * 1e3, rel=0.05, abs=slack_s * 1e3)
        assert got == pytest.approx(np.percentile(planned, p) * 1e3, rel=0.15, abs=10.0)
    assert m["mean_ttft_ms"] == pytest.approx(actual.mean() * 1e3, rel=0.05, abs=4.0)
    assert m["std_ttft_ms"] == pytest.approx(actual.std() * 1e3, rel=0.15, abs=4.0)
    # TPOT and ITL: the server schedules tokens on absolute times, ITL_S apart
    actual_tpot = [sum(s["itl_s"]) / len(s["itl_s"]) for s in sent if s["itl_s"]]
    assert m["mean_tpot_ms"] == pytest.approx(np.mean(actual_tpot) * 1e3, rel=0.05, abs=0.5)
    assert m["median_tpot_ms"] == pytest.approx(ITL_S * 1e3, abs=1.0)
    actual_itl = [g for s in sent for g in s["itl_s"]]
    assert m["median_itl_ms"] == pytest.approx(np.median(actual_itl) * 1e3, abs=1.5)
    assert m["median_itl_ms"] == pytest.approx(ITL_S * 1e3, abs=1.5)
    assert sum(len(r.itl_s) for r in rs) == sum(r.output_tokens - 1 for r in rs)
    e2e_planned = planned + ITL_S * np.array([r.output_tokens - 1 for r in rs])
    e2e = np.array([r.latency_s for r in rs])
    assert np.median(e2e - e2e_planned) == pytest.approx(0.0, abs=0.01)
    assert m["median_e2el_ms"] == pytest.approx(np.median(e2e) * 1e3)
    # usage gives the token counts; every request ran to its max_tokens
    assert all(r.output_tokens_source == "usage" for r in rs)
    assert m["total_output_tokens"] == sum(m["output_lens"]) == sum(r.output_tokens for r in rs)


def test_chat_ttft_waits_for_text_not_the_role_chunk(server: FakeServer) -> None:
    server.set(ttft_s=0.040, itl_s=0.004, role_chunk=True)
    run = run_bench(server, endpoint="/v1/chat/completions")
    assert run.metrics["completed"] == 20
    # no text exists before 40 ms; the role chunk, sent at once, would make TTFT ~1 ms
    assert min(r.ttft_s for r in run.results) >= 0.039
    assert (
        run.metrics["median_ttft_ms"] < 40.0 + 60.0
    )  # a burst of 20 cold connections may add some
    assert all(r.generated_text.startswith(" t0") for r in run.results)


def test_without_usage_tokens_are_counted_chunks(server: FakeServer) -> None:
    server.set(include_usage=False)
    run = run_bench(server, {"output_len": 9})
    assert all(r.output_tokens == 9 and r.output_tokens_source == "chunks" for r in run.results)
    assert any("the output tokens of 20 requests are counted text chunks" in w
               for w in run.warnings), run.warnings  # fmt: skip


def test_without_usage_a_tokenizer_counts_the_generated_text(
    server: FakeServer, bytelevel_tokenizer: Path
) -> None:
    """As vLLM's benchmark does: a chunk may carry several tokens, its text tells how many."""
    from nori_jax.bench.prompts import load_tokenizer

    server.set(include_usage=False)
    run = run_bench(server, {"output_len": 9}, tokenizer=str(bytelevel_tokenizer))
    tok = load_tokenizer(bytelevel_tokenizer)
    for r in run.results:
        assert r.output_tokens_source == "tokenizer"
        assert r.output_tokens == len(tok.encode(r.generated_text, add_special_tokens=False))
    assert sum(r.output_tokens for r in run.results) > 9 * 20  # " t3" is more than one token
    assert any("counted by tokenizing the generated text" in w for w in run.warnings)
    assert not any("counted text chunks" in w for w in run.warnings)


def test_warmup_requests_are_sent_but_not_reported(server: FakeServer) -> None:
    run = run_bench(server, {"warmup_requests": 3})
    assert len(run.results) == 20 and [r.index for r in run.results] == list(range(20))
    assert server.stats()["count"] == 23


def test_max_concurrency_caps_requests_in_flight(server: FakeServer) -> None:
    server.set(ttft_s=0.02, itl_s=0.005)
    run = run_bench(server, max_concurrency=3)
    assert run.metrics["max_concurrent_requests"] == 3
    assert max(r.sent_s - r.dispatched_s for r in run.results) > 0.02  # some waited for a slot


def test_two_client_processes_send_the_poisson_schedule(server: FakeServer) -> None:
    server.set(ttft_s=0.01, itl_s=0.002)
    run = run_bench(server, {"request_rate": 40.0, "num_prompts": 60}, num_processes=2)
    rs = run.results
    assert run.metrics["completed"] == 60 and run.health["client_processes"] == 2
    assert [r.index for r in rs] == list(range(60))
    lag = np.array([r.dispatched_s - r.scheduled_s for r in rs])
    assert np.percentile(lag, 90) < 0.02  # both processes follow one clock and one schedule
    assert rs[-1].scheduled_s == pytest.approx(60 / 40.0)
    assert run.metrics["request_throughput"] == pytest.approx(40.0, rel=0.2)


@pytest.mark.parametrize(
    ("endpoint", "prompt_format", "from_card"),
    [
        ("/v1/completions", "text", False),
        ("/v1/chat/completions", "text", True),
        ("/v1/completions", "token-ids", True),
    ],
)
def test_server_receives_exactly_the_drawn_input_tokens(
    server: FakeServer,
    bytelevel_tokenizer: Path,
    endpoint: str,
    prompt_format: str,
    from_card: bool,
) -> None:
    """With --tokenizer, or with none when the server's model card names its tokenizer."""
    tok = str(bytelevel_tokenizer)
    server.set(tokenizer_dir=tok, ttft_s=0.0, itl_s=0.001, model_root=tok if from_card else None)
    run = run_bench(
        server,
        {
            "dataset": "lognormal",
            "num_prompts": 16,
            "input_lengths": LognormalLengths(6.2, 0.8, 10, 1500),
            "output_lengths": LognormalLengths(1.0, 0.1, 2, 2),
        },
        endpoint=endpoint,
        prompt_format=prompt_format,
        tokenizer=None if from_card else tok,
        model=None,
    )
    assert run.metrics["completed"] == 16
    assert [r.server_prompt_tokens for r in run.results] == run.input_lens
    assert not [w for w in run.warnings if "prompt lengths" in w or "estimates" in w]
    assert run.metrics["total_input_tokens"] == sum(run.input_lens)
