"""Run metrics, defined as `vllm bench serve` defines them so numbers compare across tools.

- TTFT: send -> first chunk carrying text, per successful request (queueing included).
- TPOT: (E2E - TTFT) / (output_tokens - 1), per request with more than one output token.
- ITL: every gap between consecutive text chunks, pooled over all requests.
- E2E (e2el): send -> last text chunk.
- Throughputs divide by the run duration: schedule start -> the last request's end.
- Goodput: successful requests per second meeting every given SLO (DistServe); a one-token
  request has TPOT 0 for this purpose.
Mean, median and std are over the values above; percentiles use linear interpolation (numpy).
Empty sets report 0, as vLLM does, rather than NaN that would break JSON consumers.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import numpy as np

from nori_jax.bench.stream_request import RequestResult


@dataclasses.dataclass(frozen=True)
class Summary:
    """Statistics of one metric, in milliseconds."""

    mean: float
    median: float
    std: float
    percentiles: tuple[tuple[float, float], ...]  # (p, value)

    def at(self, p: float) -> float:
        return dict(self.percentiles)[p]


@dataclasses.dataclass(frozen=True)
class BenchmarkMetrics:
    completed: int
    failed: int
    total_input: int
    total_output: int
    duration_s: float
    request_throughput: float
    request_goodput: float | None  # None without --goodput
    output_throughput: float
    total_token_throughput: float
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    ttft: Summary
    tpot: Summary
    itl: Summary
    e2el: Summary
    output_lens: tuple[int, ...]  # per request, 0 for failures (vLLM's `output_lens`)


def tpot_s(r: RequestResult) -> float | None:
    if not r.success or r.output_tokens <= 1:
        return None
    return (r.latency_s - r.ttft_s) / (r.output_tokens - 1)


def summarize(values_s: Sequence[float], percentiles: Sequence[float]) -> Summary:
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    if ms.size == 0:
        ms = np.zeros(1)
    return Summary(
        mean=float(ms.mean()),
        median=float(np.median(ms)),
        std=float(ms.std()),
        percentiles=tuple((float(p), float(np.percentile(ms, p))) for p in percentiles),
    )


def compute_metrics(
    results: Sequence[RequestResult],
    input_lens: Sequence[int],
    duration_s: float,
    percentiles: Sequence[float],
    goodput_slos_ms: Mapping[str, float],
) -> BenchmarkMetrics:
    """`results` and `input_lens` are aligned, one entry per request of the run."""
    ok = [r for r in results if r.success]
    ttfts = [r.ttft_s for r in ok]
    tpots = [t for r in ok if (t := tpot_s(r)) is not None]
    itls = [gap for r in ok for gap in r.itl_s]
    e2els = [r.latency_s for r in ok]
    total_input = sum(n for r, n in zip(results, input_lens, strict=True) if r.success)
    output_lens = tuple(r.output_tokens if r.success else 0 for r in results)
    total_output = sum(output_lens)
    duration_s = max(duration_s, 1e-9)
    goodput = None
    if goodput_slos_ms:
        goodput = sum(_is_good(r, goodput_slos_ms) for r in ok) / duration_s
    return BenchmarkMetrics(
        completed=len(ok),
        failed=len(results) - len(ok),
        total_input=total_input,
        total_output=total_output,
        duration_s=duration_s,
        request_throughput=len(ok) / duration_s,
        request_goodput=goodput,
        output_throughput=total_output / duration_s,
        total_token_throughput=(total_input + total_output) / duration_s,
        max_output_tokens_per_s=_peak_output_rate(ok),
        max_concurrent_requests=_peak_concurrency(ok),
        ttft=summarize(ttfts, percentiles),
        tpot=summarize(tpots, percentiles),
        itl=summarize(itls, percentiles),
        e2el=summarize(e2els, percentiles),
        output_lens=output_lens,
    )


def _is_good(r: RequestResult, slos_ms: Mapping[str, float]) -> bool:
    values_ms = {
        "ttft": r.ttft_s * 1e3,
        "tpot": (tpot_s(r) or 0.0) * 1e3,
        "e2el": r.latency_s * 1e3,
    }
    return all(values_ms[name] <= slo for name, slo in slos_ms.items())


def _peak_output_rate(ok: Sequence[RequestResult]) -> float:
    """Most output tokens in any one-second bin of the run clock.

    A chunk may carry several tokens (servers batch small deltas), so each request's chunks share
    its output token count equally rather than counting one token per chunk.
    """
    if not ok:
        return 0.0
    times, weights = [], []
    for r in ok:
        chunk_times = r.sent_s + r.ttft_s + np.concatenate([[0.0], np.cumsum(r.itl_s)])
        times.append(chunk_times)
        weights.append(np.full(len(chunk_times), r.output_tokens / len(chunk_times)))
    t = np.concatenate(times)
    bins = np.floor(t - t.min()).astype(np.int64)
    return float(np.bincount(bins, weights=np.concatenate(weights)).max())


def _peak_concurrency(ok: Sequence[RequestResult]) -> int:
    """Most requests in flight at once, over half-open [send, last token) intervals."""
    events = sorted(
        [(r.sent_s, 1) for r in ok if math.isfinite(r.sent_s)]
        + [(r.sent_s + r.latency_s, -1) for r in ok if math.isfinite(r.sent_s)]
    )  # at equal times -1 sorts first: an interval that ends frees its slot before one starts
    peak = cur = 0
    for _, delta in events:
        cur += delta
        peak = max(peak, cur)
    return peak
