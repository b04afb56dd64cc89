"""A simulated sweep beside a measured one (`bench serve --sweep ... --result-json`).

The measured file's runs become `RunResult`s with their metrics (vLLM's keys), so the bench's
knee detector reads both the same way; the table gives, per offered rate measured, the
simulated and measured throughput and P99 latencies and the relative error of each.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nori_jax.bench.run import RunResult

COMPARED = (
    ("total_token_throughput", "total tok/s"),
    ("p99_ttft_ms", "TTFT P99 ms"),
    ("p99_tpot_ms", "TPOT P99 ms"),
)


def load_measured_sweep(path: str | Path) -> list[RunResult]:
    """The finite-rate runs of a `bench serve` sweep JSON (or of one run's JSON)."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
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


def comparison(sim: Sequence[RunResult], measured: Sequence[RunResult]) -> list[dict[str, Any]]:
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
        rows.append(row)
    return rows


def comparison_table(rows: Sequence[dict[str, Any]]) -> str:
    head = f"{'rate':>8}" + "".join(
        f" {label + ' sim / measured':>30} {'err':>6}" for _, label in COMPARED
    )
    lines = [" Simulated vs measured ".center(len(head), "="), head]
    for row in rows:
        cells = []
        for key, _ in COMPARED:
            c = row[key]
            err = "" if c["rel_error"] is None else f"{c['rel_error']:+.0%}"
            cells.append(f" {c['simulated']:>14.1f} / {c['measured']:<13.1f} {err:>6}")
        lines.append(f"{row['request_rate']:>8g}" + "".join(cells))
    return "\n".join(lines)
