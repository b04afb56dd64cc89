"""Run metrics under `vllm bench serve`'s key names and definitions, and the client's health.

- TTFT: send -> first chunk carrying text, per successful request (queueing included).
- TPOT: (E2E - TTFT) / (output_tokens - 1), per request with more than one output token.
- ITL: every gap between consecutive text chunks, pooled over all requests.
- E2E (e2el): send -> last text chunk.
- Throughputs divide by the run duration: schedule start -> the last request's end.
- Goodput: successful requests per second meeting every given SLO (DistServe); a one-token
  request has TPOT 0 for this purpose.
Mean, median and std are over the values above; percentiles use linear interpolation (numpy).
Empty sets report 0, as vLLM does, rather than NaN that would break JSON consumers. Failed
requests are in none of them (a warning says so when more than 1% failed).

Two keys of our own say whether the run measured a server that kept up:
- `achieved_request_rate`: requests sent per second over the sending window (the offered rate
  the server actually saw; below the configured one when the client fell behind);
- `ttft_growth`: the median TTFT of the last fifth of the requests (by send time) over the first
  fifth's (`ttft_growth_ms`: the one minus the other). About 1 when the queue is steady; a server
  that cannot keep up with the offered rate queues more and more, and its TTFT grows over the run
  (sweep.py's knee uses it).

Client health, the evidence that the client is not the bottleneck: send lag (requests leaving
after their scheduled time, checked at finite rates), event-loop lag (a busy loop reads chunks
late, which inflates TTFT and ITL) and CPU saturation of a client process.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from nori_jax.bench.client import RequestResult, ShardOutcome

SEND_LAG_WARN_MS = 10.0
LOOP_LAG_WARN_MS = 10.0
# Timing error of a quarter of a typical token gap is already a visible distortion of ITL/TPOT.
LOOP_LAG_WARN_ITL_FRACTION = 0.25
LOOP_LAG_FLOOR_MS = 1.0  # below this, scheduler jitter of a healthy loop would raise alarms
CPU_UTIL_WARN = 0.9
# Requests leaving slower than this share of the planned rate: the configured load was not offered
ACHIEVED_RATE_WARN_FRACTION = 0.9


def percentile_word(p: float) -> str:
    """99.0 -> '99', 99.9 -> '99.9': the spelling of vLLM's `p99_ttft_ms` keys."""
    return str(int(p)) if int(p) == p else str(p)


def tpot_s(r: RequestResult) -> float | None:
    if not r.success or r.output_tokens <= 1:
        return None
    return (r.latency_s - r.ttft_s) / (r.output_tokens - 1)


def compute_metrics(
    results: Sequence[RequestResult],
    input_lens: Sequence[int],
    duration_s: float,
    percentiles: Sequence[float],
    goodput_slos_ms: Mapping[str, float],
) -> dict[str, Any]:
    """vLLM's result keys; `results` and `input_lens` are aligned, one per request of the run."""
    ok = [r for r in results if r.success]
    output_lens = [r.output_tokens if r.success else 0 for r in results]
    total_in = sum(n for r, n in zip(results, input_lens, strict=True) if r.success)
    total_out = sum(output_lens)
    duration_s = max(duration_s, 1e-9)
    m: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration": duration_s,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration_s,
        "request_goodput": (
            sum(_is_good(r, goodput_slos_ms) for r in ok) / duration_s if goodput_slos_ms else None
        ),
        "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
        "max_output_tokens_per_s": _peak_output_rate(ok),
        "max_concurrent_requests": _peak_concurrency(ok),
        "output_lens": output_lens,
        "achieved_request_rate": _achieved_rate(results),
        **_ttft_growth(ok),
    }
    values = {
        "ttft": [r.ttft_s for r in ok],
        "tpot": [t for r in ok if (t := tpot_s(r)) is not None],
        "itl": [gap for r in ok for gap in r.itl_s],
        "e2el": [r.latency_s for r in ok],
    }
    for name, vals in values.items():
        ms = np.asarray(vals, dtype=np.float64) * 1e3 if vals else np.zeros(1)
        m[f"mean_{name}_ms"] = float(ms.mean())
        m[f"median_{name}_ms"] = float(np.median(ms))
        m[f"std_{name}_ms"] = float(ms.std())
        for p in percentiles:
            m[f"p{percentile_word(p)}_{name}_ms"] = float(np.percentile(ms, p))
    return m


def _achieved_rate(results: Sequence[RequestResult]) -> float:
    """Requests sent per second between the first send and the last (0 for fewer than 2)."""
    return _sending_rate([r.sent_s for r in results])


def _sending_rate(times: Sequence[float]) -> float:
    """Events per second between the first of `times` and the last (0 for fewer than 2)."""
    sent = sorted(t for t in times if math.isfinite(t))
    if len(sent) < 2 or sent[-1] <= sent[0]:
        return 0.0
    return (len(sent) - 1) / (sent[-1] - sent[0])


def rate_warnings(
    results: Sequence[RequestResult], rate: float, max_concurrency: int | None
) -> list[str]:
    """A warning when requests left at under 0.9x the rate the schedule planned: the server then
    saw a lighter load than the configured one. With --max-concurrency, the usual cause is
    requests queueing in the client for a free slot, which the P99 queue time shows."""
    if not math.isfinite(rate):
        return []
    planned = _sending_rate([r.scheduled_s for r in results])
    achieved = _achieved_rate(results)
    if planned <= 0 or achieved >= ACHIEVED_RATE_WARN_FRACTION * planned:
        return []
    message = (
        f"requests left at {achieved:.2f} req/s, below the configured {rate:g} req/s: the server "
        "saw a lighter load than configured"
    )
    queued = np.array([r.sent_s - r.dispatched_s for r in results])
    queued = queued[np.isfinite(queued)]
    p99_queue_s = float(np.percentile(queued, 99)) if queued.size else 0.0
    if max_concurrency is not None and p99_queue_s * 1e3 > SEND_LAG_WARN_MS:
        message += (
            f"; they queued in the client for one of the --max-concurrency {max_concurrency} "
            f"slots (P99 queue time {p99_queue_s:.2f} s): lower the rate or raise "
            "--max-concurrency"
        )
    return [message]


def _ttft_growth(ok: Sequence[RequestResult]) -> dict[str, float]:
    """`ttft_growth`: the median TTFT of the last fifth of the requests by send time over the
    first fifth's, and `ttft_growth_ms`: the one minus the other (1.0 and 0.0 with fewer than 10
    requests; the ratio 1.0 when the first fifth's is 0)."""
    by_send = sorted((r for r in ok if math.isfinite(r.sent_s)), key=lambda r: r.sent_s)
    fifth = len(by_send) // 5
    if fifth < 2:
        return {"ttft_growth": 1.0, "ttft_growth_ms": 0.0}
    first = float(np.median([r.ttft_s for r in by_send[:fifth]]))
    last = float(np.median([r.ttft_s for r in by_send[-fifth:]]))
    return {
        "ttft_growth": last / first if first > 0 else 1.0,
        "ttft_growth_ms": (last - first) * 1e3,
    }


def _is_good(r: RequestResult, slos_ms: Mapping[str, float]) -> bool:
    values_ms = {"ttft": r.ttft_s, "tpot": tpot_s(r) or 0.0, "e2el": r.latency_s}
    return all(values_ms[name] * 1e3 <= slo for name, slo in slos_ms.items())


def _peak_output_rate(ok: Sequence[RequestResult]) -> float:
    """Most output tokens in any one-second bin of the run clock. A chunk may carry several
    tokens, so each request's chunks share its output token count equally."""
    if not ok:
        return 0.0
    times = [r.sent_s + r.ttft_s + np.concatenate([[0.0], np.cumsum(r.itl_s)]) for r in ok]
    weights = [np.full(len(t), r.output_tokens / len(t)) for r, t in zip(ok, times, strict=True)]
    t = np.concatenate(times)
    bins = np.floor(t - t.min()).astype(np.int64)
    return float(np.bincount(bins, weights=np.concatenate(weights)).max())


def _peak_concurrency(ok: Sequence[RequestResult]) -> int:
    """Most requests in flight at once, over half-open [send, last token) intervals."""
    sent = [r for r in ok if math.isfinite(r.sent_s)]
    events = sorted([(r.sent_s, 1) for r in sent] + [(r.sent_s + r.latency_s, -1) for r in sent])
    # at equal times -1 sorts first: an interval that ends frees its slot before one starts
    return int(max(np.cumsum([d for _, d in events]), default=0))


def client_health(
    outcomes: Sequence[ShardOutcome], finite_rate: bool, median_itl_ms: float
) -> tuple[dict[str, Any], list[str]]:
    """The `client_*` result keys and a warning for each symptom, with its numbers."""
    send_lags = np.array(
        [r.dispatched_s - r.scheduled_s for o in outcomes for r in o.results]
    )  # NaN for requests never dispatched
    send_lags = send_lags[np.isfinite(send_lags)]
    loop_lags = np.array([lag for o in outcomes for lag in o.loop_lags_s])
    p99 = lambda a: float(np.percentile(a, 99) * 1e3) if a.size else 0.0  # noqa: E731
    health = {
        "client_processes": len(outcomes),
        "client_send_lag_p99_ms": p99(send_lags),
        "client_loop_lag_p99_ms": p99(loop_lags),
        "client_cpu_util_max": max((o.cpu_util for o in outcomes), default=0.0),
    }
    advice = (
        "the client may be the bottleneck: give it more processes (--num-client-processes) "
        "or a machine with idle cores"
    )
    warnings = []
    if finite_rate and health["client_send_lag_p99_ms"] > SEND_LAG_WARN_MS:
        warnings.append(
            f"requests left the client late: P99 send lag {health['client_send_lag_p99_ms']:.1f}"
            f" ms (max {send_lags.max() * 1e3:.1f} ms) behind the schedule; {advice}"
        )
    limit = LOOP_LAG_WARN_MS
    if median_itl_ms > 0:
        limit = max(min(limit, LOOP_LAG_WARN_ITL_FRACTION * median_itl_ms), LOOP_LAG_FLOOR_MS)
    if health["client_loop_lag_p99_ms"] > limit:
        warnings.append(
            f"client event loop lagging: P99 {health['client_loop_lag_p99_ms']:.1f} ms (limit "
            f"{limit:.1f} ms, median ITL {median_itl_ms:.1f} ms), so chunk timestamps are late; "
            f"{advice}"
        )
    if health["client_cpu_util_max"] > CPU_UTIL_WARN:
        warnings.append(
            f"a client process used {health['client_cpu_util_max']:.0%} of a CPU core; {advice}"
        )
    return health, warnings
