"""A simulated sweep beside a measured one (`bench serve --sweep ... --result-json`).

The measured file's runs become `RunResult`s with their metrics (vLLM's keys), so the bench's
knee detector reads both the same way; the table gives, per offered rate measured, the
simulated and measured throughput and P99 latencies and the relative error of each, and the
mean engine step when the measured runs carry it (`bench serve` reads it from the server's
/metrics: `server_mean_step_ms`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from nori_jax.bench.run import RunResult

COMPARED = (
    ("total_token_throughput", "total tok/s"),
    ("p99_ttft_ms", "TTFT P99 ms"),
    ("p99_tpot_ms", "TPOT P99 ms"),
)
# Compared where both sides have it: the measured one comes from the server's /metrics.
STEP = ("server_mean_step_ms", "step ms")


def load_measured_sweep(path: str | Path) -> list[RunResult]:
    """The finite-rate runs of a `bench serve` sweep JSON (or of one run's JSON)."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read the measured sweep {str(path)!r}: {e}") from None
    runs = data.get("runs", [data]) if isinstance(data, dict) else None
    if not runs or not all(isinstance(r, dict) for r in runs):
        raise ValueError(f"{path}: not a bench serve result (no runs)")
    out = []
    for r in runs:
        missing = [k for k, _ in COMPARED if k not in r] + [
            k for k in ("request_rate", "completed", "failed") if k not in r
        ]
        if missing:
            raise ValueError(f"{path}: a run lacks {missing}")
        rate = float(r["request_rate"])
        if math.isfinite(rate):
            out.append(RunResult(rate, r, [], [], {}, []))
    if not out:
        raise ValueError(f"{path}: no run at a finite request rate")
    return sorted(out, key=lambda r: r.request_rate)


def _err(sim: float, measured: float) -> float | None:
    return (sim - measured) / measured if measured else None


def simulated_step_ms(run: RunResult, steps: int) -> float | None:
    """The simulated counterpart of the server's mean step (`nori:step_duration_seconds`: one
    engine iteration's wall time, scheduling to post-processed outputs, observed only for
    iterations that launch or fetch a step). The simulated core runs iterations back to back
    while it holds a request and sits idle otherwise, so its steps' wall time is the union of the
    requests' [arrival, last token] spans; that over its steps is the mean. A frontend stage
    (`--frontend-*`) delays the last tokens and adds a little; None without steps."""
    spans = sorted(
        (r.sent_s, r.sent_s + r.latency_s)
        for r in run.results
        if r.success and math.isfinite(r.sent_s)
    )
    busy, end = 0.0, -math.inf
    for a, b in spans:
        if b > end:
            busy += b - max(a, end)
            end = b
    return 1e3 * busy / steps if steps > 0 else None


def comparison(
    sim: Sequence[RunResult],
    measured: Sequence[RunResult],
    sim_step_ms: Mapping[float, float | None] | None = None,
) -> list[dict[str, Any]]:
    """Per measured rate that was simulated: each COMPARED key's simulated and measured value and
    relative error; STEP's too where the measured run has it and `sim_step_ms` (by rate) does."""
    by_rate = {r.request_rate: r for r in sim}
    rows = []
    for m in measured:
        s = by_rate.get(m.request_rate)
        if s is None:
            continue
        row: dict[str, Any] = {"request_rate": m.request_rate}
        for key, _ in COMPARED:
            row[key] = {
                "simulated": s.metrics[key],
                "measured": m.metrics[key],
                "rel_error": _err(s.metrics[key], m.metrics[key]),
            }
        measured_step = m.metrics.get(STEP[0])
        simulated_step = (sim_step_ms or {}).get(m.request_rate)
        if measured_step is not None and simulated_step is not None:
            row[STEP[0]] = {
                "simulated": simulated_step,
                "measured": measured_step,
                "rel_error": _err(simulated_step, measured_step),
            }
        rows.append(row)
    return rows


def comparison_table(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a table; the step column only when some row has it."""
    columns = [(key, label, ".1f") for key, label in COMPARED]
    if any(STEP[0] in row for row in rows):
        columns.append((*STEP, ".2f"))
    head = f"{'rate':>8}" + "".join(
        f" {label + ' sim / measured':>30} {'err':>6}" for _, label, _ in columns
    )
    lines = [" Simulated vs measured ".center(len(head), "="), head]
    for row in rows:
        cells = []
        for key, _, fmt in columns:
            c = row.get(key)
            if c is None:
                cells.append(f" {'-':>14}   {'-':<13} {'':>6}")
                continue
            err = "" if c["rel_error"] is None else f"{c['rel_error']:+.0%}"
            cells.append(f" {c['simulated']:>14{fmt}} / {c['measured']:<13{fmt}} {err:>6}")
        lines.append(f"{row['request_rate']:>8g}" + "".join(cells))
    return "\n".join(lines)
