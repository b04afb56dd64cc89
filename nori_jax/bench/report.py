"""Results as `vllm bench serve` shows them: the printed block, its JSON keys, plus a CSV.

The JSON of one run uses vLLM's key names and meanings (`completed`, `request_throughput`,
`mean_ttft_ms`, `p99_itl_ms`, `ttfts`, `itls`, ...), so scripts written for vLLM's result files
read ours; keys vLLM does not have (client health, warnings, dataset) are additions, never
renamings.
"""

from __future__ import annotations

import collections
import csv
import datetime
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from nori_jax.bench.config import METRIC_NAMES, BenchConfig
from nori_jax.bench.metrics import percentile_word, tpot_s
from nori_jax.bench.run import RunResult, Workload
from nori_jax.bench.server_metrics import ERROR_KEY, SERVER_KEYS, SHAPES_KEY
from nori_jax.core.step_shapes import format_rows

_WIDTH = 50
_HEADERS = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}


def load_header(cfg: BenchConfig, rate: float) -> str:
    shape = "Poisson process" if cfg.workload.burstiness == 1.0 else "Gamma distribution"
    return (
        f"Traffic request rate: {rate}\n"
        f"Burstiness factor: {cfg.workload.burstiness} ({shape})\n"
        f"Maximum request concurrency: {cfg.max_concurrency}"
    )


def print_run(cfg: BenchConfig, run: RunResult, out: TextIO) -> None:
    m = run.metrics

    def row(label: str, key: str, fmt: str = ".2f") -> None:
        print(f"{label:<40} {m[key]:<10{fmt}}", file=out)

    print(" Serving Benchmark Result ".center(_WIDTH, "="), file=out)
    row("Successful requests:", "completed", "")
    row("Failed requests:", "failed", "")
    if cfg.max_concurrency is not None:
        print(f"{'Maximum request concurrency:':<40} {cfg.max_concurrency:<10}", file=out)
    if math.isfinite(run.request_rate):
        print(f"{'Request rate configured (RPS):':<40} {run.request_rate:<10.2f}", file=out)
    row("Request rate achieved (sent/s):", "achieved_request_rate")
    row("TTFT growth over the run (last/first):", "ttft_growth")
    row("Benchmark duration (s):", "duration")
    row("Total input tokens:", "total_input_tokens", "")
    row("Total generated tokens:", "total_output_tokens", "")
    row("Request throughput (req/s):", "request_throughput")
    if m["request_goodput"] is not None:
        row("Request goodput (req/s):", "request_goodput")
    row("Output token throughput (tok/s):", "output_throughput")
    row("Peak output token throughput (tok/s):", "max_output_tokens_per_s")
    row("Peak concurrent requests:", "max_concurrent_requests")
    row("Total token throughput (tok/s):", "total_token_throughput")
    for name in cfg.percentile_metrics:
        short, header = _HEADERS[name]
        print(header.center(_WIDTH, "-"), file=out)
        row(f"Mean {short} (ms):", f"mean_{name}_ms")
        row(f"Median {short} (ms):", f"median_{name}_ms")
        for p in cfg.metric_percentiles:
            row(f"P{percentile_word(p)} {short} (ms):", f"p{percentile_word(p)}_{name}_ms")
    if run.server:
        _print_server(run.server, out)
    print("=" * _WIDTH, file=out)
    reasons = collections.Counter(r.error for r in run.results if not r.success)
    if reasons:
        print(f"Failed requests by reason ({m['failed']}):", file=out)
        for reason, count in reasons.most_common(10):
            print(f"  {count:>6}  {reason}", file=out)
    for warning in run.warnings:
        print(f"WARNING: {warning}", file=out)
    if run.interrupted:
        print(
            f"Interrupted (Ctrl-C): partial results, {m['completed']} of {len(run.results)} "
            "requests completed",
            file=out,
        )


# The "Server" block's rows: label, key, format (benchmarks/plan/report_to_sweep.py reads them)
SERVER_ROWS = (
    ("Engine steps:", "server_steps", "d"),
    ("Mean step time (ms):", "server_mean_step_ms", ".2f"),
    ("Mean scheduler time (ms):", "server_mean_scheduler_ms", ".3f"),
    ("Tokens per step:", "server_tokens_per_step", ".1f"),
    ("Mean core I/O per step (ms):", "server_mean_core_io_ms", ".3f"),
    ("Mean TTFT at the engine (ms):", "server_mean_ttft_ms", ".2f"),
)


def _print_server(server: dict[str, Any], out: TextIO) -> None:
    """The server's own numbers over the run, from its /metrics (server_metrics.py)."""
    print("Server (engine steps, from /metrics)".center(_WIDTH, "-"), file=out)
    if server.get("server_steps") is None:
        print(f"Not available: {server.get(ERROR_KEY) or 'no data'}", file=out)
        return
    for label, key, fmt in SERVER_ROWS:
        value = server.get(key)
        print(f"{label:<40} {'n/a' if value is None else format(value, fmt):<10}", file=out)
    if server.get(SHAPES_KEY):
        print(format_rows(server[SHAPES_KEY], "Launches by step shape", _WIDTH, "-"), file=out)


def result_dict(cfg: BenchConfig, w: Workload, run: RunResult) -> dict[str, Any]:
    rs = run.results
    latency = tuple(f"_{name}_ms" for name in METRIC_NAMES)
    wanted = tuple(f"_{name}_ms" for name in cfg.percentile_metrics)
    return {
        "date": datetime.datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": "openai-chat" if cfg.chat else "openai",
        "label": cfg.label,
        "model_id": w.model,
        "tokenizer_id": w.tokenizer,
        "num_prompts": len(rs),
        "request_rate": run.request_rate if math.isfinite(run.request_rate) else "inf",
        "burstiness": cfg.workload.burstiness,
        "max_concurrency": cfg.max_concurrency,
        **{k: v for k, v in run.metrics.items() if not k.endswith(latency) or k.endswith(wanted)},
        "input_lens": run.input_lens,
        "ttfts": [r.ttft_s for r in rs],
        "itls": [r.itl_s for r in rs],
        "latencies": [r.latency_s for r in rs],
        "start_times": [_finite(r.sent_s) for r in rs],
        "queue_times": [_finite(r.sent_s - r.dispatched_s) for r in rs],
        "errors": [r.error for r in rs],
        "generated_texts": [r.generated_text for r in rs],
        # additions: what makes a number reproducible and trustworthy
        "endpoint": cfg.endpoint,
        "dataset": cfg.workload.dataset,
        "prompt_format": cfg.prompt_format,
        "ignore_eos": cfg.ignore_eos,
        "seed": cfg.workload.seed,
        "goodput_slos_ms": dict(cfg.goodput_slos_ms),
        **run.health,
        **{k: run.server.get(k) for k in (*SERVER_KEYS, SHAPES_KEY, ERROR_KEY)},
        "warnings": run.warnings,
        "interrupted": run.interrupted,
    }


def write_json(path: str | Path, obj: Any) -> None:
    Path(path).write_text(json.dumps(obj, indent=2, allow_nan=False) + "\n")


CSV_COLUMNS = (
    "request_rate", "index", "success", "error", "http_status", "scheduled_s", "sent_s",
    "send_lag_ms", "queue_ms", "prompt_tokens", "server_prompt_tokens", "max_tokens",
    "output_tokens", "output_tokens_source", "num_chunks", "ttft_ms", "tpot_ms", "mean_itl_ms",
    "max_itl_ms", "e2el_ms", "finish_reason",
)  # fmt: skip


def write_csv(path: str | Path, w: Workload, runs: Sequence[RunResult]) -> None:
    """One row per request of every run, failures included with their reason."""
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(CSV_COLUMNS)
        for run in runs:
            for req, r, n_in in zip(w.requests, run.results, run.input_lens, strict=True):
                tpot, chunks = tpot_s(r), len(r.itl_s) + 1 if r.ttft_s > 0 else 0
                writer.writerow([
                    run.request_rate, r.index, int(r.success), r.error, r.http_status or "",
                    _fmt(r.scheduled_s), _fmt(r.sent_s), _ms(r.dispatched_s - r.scheduled_s),
                    _ms(r.sent_s - r.dispatched_s), n_in,
                    "" if r.server_prompt_tokens is None else r.server_prompt_tokens,
                    req.output_len, r.output_tokens,
                    r.output_tokens_source, chunks,
                    _ms(r.ttft_s) if r.success else "", "" if tpot is None else _ms(tpot),
                    _ms(sum(r.itl_s) / len(r.itl_s)) if r.itl_s else "",
                    _ms(max(r.itl_s)) if r.itl_s else "", _ms(r.latency_s),
                    r.finish_reason or "",
                ])  # fmt: skip


# The sweep table's server columns: header, key, format
_SERVER_COLUMNS = (
    ("step ms", "server_mean_step_ms", ".2f"),
    ("sched ms", "server_mean_scheduler_ms", ".3f"),
    ("tok/step", "server_tokens_per_step", ".1f"),
    ("io ms", "server_mean_core_io_ms", ".3f"),
    ("eng TTFT", "server_mean_ttft_ms", ".1f"),
)


def sweep_table(runs: Sequence[RunResult]) -> str:
    """One line per rate: what the knee is read from, and the server's mean step (its /metrics)
    when some run has it."""
    server = any(run.server.get("server_steps") is not None for run in runs)
    head = (
        f"{'rate':>8} {'req/s':>8} {'total tok/s':>12} {'TTFT P50':>9} {'TTFT P99':>9} "
        f"{'TPOT P50':>9} {'TPOT P99':>9} {'failed':>6}"
    )
    if server:
        head += "".join(f" {name:>9}" for name, _, _ in _SERVER_COLUMNS)
    lines = [" Rate sweep ".center(len(head), "="), head]
    for run in runs:
        m = run.metrics
        line = (
            f"{run.request_rate:>8g} {m['request_throughput']:>8.2f} "
            f"{m['total_token_throughput']:>12.1f} {m['median_ttft_ms']:>9.1f} "
            f"{m['p99_ttft_ms']:>9.1f} {m['median_tpot_ms']:>9.1f} {m['p99_tpot_ms']:>9.1f} "
            f"{m['failed']:>6d}"
        )
        if server:
            for _, key, fmt in _SERVER_COLUMNS:
                value = run.server.get(key)
                line += f" {'-' if value is None else format(value, fmt):>9}"
        lines.append(line)
    return "\n".join(lines)


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _fmt(x: float) -> str:
    return f"{x:.6f}" if math.isfinite(x) else ""


def _ms(x: float) -> str:
    return f"{x * 1e3:.3f}" if math.isfinite(x) else ""
