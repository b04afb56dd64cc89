"""The server's own view of a run: its engine steps, read from its Prometheus /metrics.

The client measures latency from the outside, where a server's slow steps and a slow network look
the same. This engine exports what its core did (nori_jax/metrics.py):
`nori:step_duration_seconds` (wall time of one engine step), `nori:scheduler_duration_seconds`
(host time to schedule a step and build its plan) and the token counters. `bench serve` reads
/metrics right before a rate's measured requests start (after the warm-up) and right after they
end, and reports the differences:

- server_steps: engine steps in the window (the step histogram's count),
- server_mean_step_ms: their mean wall time (its sum / count),
- server_mean_scheduler_ms: the mean host time to schedule and plan a step,
- server_tokens_per_step: (generated + prompt tokens) / steps; prompt tokens are counted when a
  request finishes, so over a window holding whole requests this is every token through a step;
- server_mean_core_io_ms: the engine-core process's time outside its steps per step
  (`nori:engine_core_io_seconds`: requests off its socket, outputs to the API servers), which
  the step's own time leaves out; 0 for an engine in the API server's process (no sockets);
- server_step_shapes: the launches by token bucket and kind (decode / mixed / prefill), each
  with its count, mean wall time and share of the window's launch time
  (`nori:step_launches_total`, `nori:step_launch_seconds_total`; core/step_shapes.py): the
  served counterpart of `bench offline`'s "Wall time by step shape" table;
- server_mean_ttft_ms: the mean time to first token as the engine sees it
  (`nori:time_to_first_token_seconds`: from the request's arrival at the API server's engine
  client, after HTTP, validation and tokenization, to its first token out of the core's step).
  The client's mean TTFT less this is the path outside the engine: HTTP in, the API server, and
  the first token's way back out.

Every series is summed over its label sets, so a data-parallel server's `replica="i"` series
give the totals of every replica (its mean step is then over every replica's steps). With several
API server processes (`serve --api-server-count N`) a scrape reaches any one of them, and that is
enough: the engine core sends every API server every step's stats and finishes, so each server's
/metrics holds the whole engine's numbers.

A server without them (vLLM, SGLang, a proxy), or one whose /metrics fails or does not parse,
leaves every field None; the run carries on.
"""

from __future__ import annotations

import dataclasses
import urllib.request
from collections.abc import Mapping
from typing import Any

SERVER_KEYS = (
    "server_steps",
    "server_mean_step_ms",
    "server_mean_scheduler_ms",
    "server_tokens_per_step",
    "server_mean_core_io_ms",
    "server_mean_ttft_ms",
)
SHAPES_KEY = "server_step_shapes"  # a list of rows (shape_rows), not a scalar like SERVER_KEYS
ERROR_KEY = "server_metrics_error"  # why the fields are None (no /metrics, unparsable, ...)
SCRAPE_TIMEOUT_S = 10.0

_STEP = "nori:step_duration_seconds"
_SCHEDULER = "nori:scheduler_duration_seconds"
_SAMPLES = {
    f"{_STEP}_count": "step_count",
    f"{_STEP}_sum": "step_sum",
    f"{_SCHEDULER}_count": "scheduler_count",
    f"{_SCHEDULER}_sum": "scheduler_sum",
    "nori:generation_tokens_total": "generation_tokens",
    "nori:prompt_tokens_total": "prompt_tokens",
    "nori:engine_core_io_seconds_total": "core_io_sum",
    "nori:time_to_first_token_seconds_count": "ttft_count",
    "nori:time_to_first_token_seconds_sum": "ttft_sum",
}
# Counters labelled by step shape: sample name -> the (count, seconds) slot it fills
_SHAPE_SAMPLES = {"nori:step_launches_total": 0, "nori:step_launch_seconds_total": 1}


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """One scrape's running totals; None for a series the server does not export."""

    step_count: float
    step_sum: float
    scheduler_count: float | None = None
    scheduler_sum: float | None = None
    generation_tokens: float | None = None
    prompt_tokens: float | None = None
    core_io_sum: float | None = None
    ttft_count: float | None = None
    ttft_sum: float | None = None
    # (bucket, kind) -> (launches, seconds), summed over the other labels (replicas); empty for
    # a server that does not export them
    shapes: Mapping[tuple[str, str], tuple[float, float]] = dataclasses.field(
        default_factory=dict, hash=False
    )


def parse(text: str) -> Snapshot:
    """The totals of a Prometheus exposition; ValueError if it does not parse or has no steps."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    shapes: dict[tuple[str, str], list[float]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if (field := _SAMPLES.get(s.name)) is not None:
                    totals[field] = totals.get(field, 0.0) + float(s.value)
                elif (slot := _SHAPE_SAMPLES.get(s.name)) is not None:
                    key = (s.labels.get("bucket", ""), s.labels.get("kind", ""))
                    shapes.setdefault(key, [0.0, 0.0])[slot] += float(s.value)
    except Exception as e:  # the parser raises ValueError, and others on odd input
        raise ValueError(f"unparsable /metrics ({type(e).__name__}: {e})") from None
    if "step_count" not in totals or "step_sum" not in totals:
        raise ValueError(f"no {_STEP} in /metrics (not this engine's server?)")
    return Snapshot(**totals, shapes={k: (v[0], v[1]) for k, v in shapes.items()})


def scrape(
    base_url: str, headers: Mapping[str, str], timeout_s: float = SCRAPE_TIMEOUT_S
) -> Snapshot | str:
    """The server's totals now, or why they cannot be read. Never raises: a benchmark carries on
    whatever its server's /metrics does."""
    url = base_url.rstrip("/") + "/metrics"
    # no proxies: like the load, straight to the server
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    request = urllib.request.Request(url, headers=dict(headers))
    try:
        with opener.open(request, timeout=timeout_s) as r:
            text = r.read().decode("utf-8", errors="replace")
        return parse(text)
    except ValueError as e:
        return str(e)
    except Exception as e:  # refused, HTTP 404, timeout, a connection reset
        return f"could not read {url} ({type(e).__name__}: {e})"


def window(before: Snapshot | str, after: Snapshot | str) -> dict[str, Any]:
    """The run's server fields (SERVER_KEYS, each None if unknown) and ERROR_KEY."""
    out: dict[str, Any] = dict.fromkeys(SERVER_KEYS) | {SHAPES_KEY: None, ERROR_KEY: None}
    for snap in (before, after):
        if isinstance(snap, str):
            out[ERROR_KEY] = snap
            return out
    assert isinstance(before, Snapshot) and isinstance(after, Snapshot)

    def delta(field: str) -> float | None:
        a, b = getattr(before, field), getattr(after, field)
        return None if a is None or b is None else b - a

    steps, step_s = delta("step_count"), delta("step_sum")
    if steps is None or step_s is None or steps < 0 or step_s < 0:
        out[ERROR_KEY] = "the server's counters went back (a restarted server?)"
        return out
    out["server_steps"] = int(round(steps))
    if steps > 0:
        out["server_mean_step_ms"] = 1e3 * step_s / steps
        tokens = [delta("generation_tokens"), delta("prompt_tokens")]
        if all(t is not None and t >= 0 for t in tokens):
            out["server_tokens_per_step"] = sum(tokens) / steps  # type: ignore[arg-type]
    sched, sched_s = delta("scheduler_count"), delta("scheduler_sum")
    if sched and sched > 0 and sched_s is not None and sched_s >= 0:
        out["server_mean_scheduler_ms"] = 1e3 * sched_s / sched
    firsts, ttft_s = delta("ttft_count"), delta("ttft_sum")
    if firsts and firsts > 0 and ttft_s is not None and ttft_s >= 0:
        out["server_mean_ttft_ms"] = 1e3 * ttft_s / firsts
    io_s = delta("core_io_sum")
    if steps > 0 and io_s is not None and io_s >= 0:
        out["server_mean_core_io_ms"] = 1e3 * io_s / steps
    if after.shapes:
        out[SHAPES_KEY] = shape_rows(before.shapes, after.shapes)
    return out


def _bucket_order(key: tuple[str, str]) -> tuple[int, str, str]:
    bucket, kind = key
    return (int(bucket) if bucket.isdigit() else 1 << 62, bucket, kind)


def shape_rows(
    before: Mapping[tuple[str, str], tuple[float, float]],
    after: Mapping[tuple[str, str], tuple[float, float]],
) -> list[dict[str, Any]]:
    """The window's launches by (bucket, kind), shapes with launches in it only, by bucket:
    bucket, kind, launches, ms_per_launch, seconds, share (of the rows' seconds)."""
    rows = []
    for key in sorted(after, key=_bucket_order):
        n0, s0 = before.get(key, (0.0, 0.0))
        n1, s1 = after[key]
        if n1 - n0 >= 1:
            launches = int(round(n1 - n0))
            seconds = max(0.0, s1 - s0)
            rows.append(
                {
                    "bucket": key[0],
                    "kind": key[1],
                    "launches": launches,
                    "seconds": seconds,
                    "ms_per_launch": 1e3 * seconds / launches,
                }  # fmt: skip
            )
    total = sum(r["seconds"] for r in rows) or 1.0
    for r in rows:
        r["share"] = r["seconds"] / total
    return rows
