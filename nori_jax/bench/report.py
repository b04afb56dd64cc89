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

from nori_jax.bench.config import BenchConfig
from nori_jax.bench.metrics import Summary, tpot_s
from nori_jax.bench.runner import RunResult, Workload

_WIDTH = 50
_HEADERS = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}


def percentile_word(p: float) -> str:
    """99.0 -> '99', 99.9 -> '99.9': the spelling of vLLM's `p99_ttft_ms` keys."""
    return str(int(p)) if int(p) == p else str(p)


def load_header(cfg: BenchConfig, rate: float) -> str:
    shape = "Poisson process" if cfg.load.burstiness == 1.0 else "Gamma distribution"
    return (
        f"Traffic request rate: {rate}\n"
        f"Burstiness factor: {cfg.load.burstiness} ({shape})\n"
        f"Maximum request concurrency: {cfg.load.max_concurrency}"
    )


def print_run(cfg: BenchConfig, run: RunResult, out: TextIO) -> None:
    m = run.metrics

    def row(label: str, value: float | int | str, fmt: str = "") -> None:
        print(f"{label:<40} {value:<10{fmt}}", file=out)

    print(" Serving Benchmark Result ".center(_WIDTH, "="), file=out)
    row("Successful requests:", m.completed)
    row("Failed requests:", m.failed)
    if cfg.load.max_concurrency is not None:
        row("Maximum request concurrency:", cfg.load.max_concurrency)
    if math.isfinite(run.request_rate):
        row("Request rate configured (RPS):", run.request_rate, ".2f")
    row("Benchmark duration (s):", m.duration_s, ".2f")
    row("Total input tokens:", m.total_input)
    row("Total generated tokens:", m.total_output)
    row("Request throughput (req/s):", m.request_throughput, ".2f")
    if m.request_goodput is not None:
        row("Request goodput (req/s):", m.request_goodput, ".2f")
    row("Output token throughput (tok/s):", m.output_throughput, ".2f")
    row("Peak output token throughput (tok/s):", m.max_output_tokens_per_s, ".2f")
    row("Peak concurrent requests:", m.max_concurrent_requests, ".2f")
    row("Total token throughput (tok/s):", m.total_token_throughput, ".2f")
    for name in cfg.report.percentile_metrics:
        short, header = _HEADERS[name]
        s: Summary = getattr(m, name)
        print(header.center(_WIDTH, "-"), file=out)
        row(f"Mean {short} (ms):", s.mean, ".2f")
        row(f"Median {short} (ms):", s.median, ".2f")
        for p, value in s.percentiles:
            row(f"P{percentile_word(p)} {short} (ms):", value, ".2f")
    print("=" * _WIDTH, file=out)
    reasons = collections.Counter(r.error for r in run.results if not r.success)
    if reasons:
        print(f"Failed requests by reason ({m.failed}):", file=out)
        for reason, count in reasons.most_common(10):
            print(f"  {count:>6}  {reason}", file=out)
    for warning in run.warnings:
        print(f"WARNING: {warning}", file=out)


def result_dict(cfg: BenchConfig, workload: Workload, run: RunResult) -> dict[str, Any]:
    m, rs = run.metrics, run.results
    result: dict[str, Any] = {
        "date": datetime.datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": "openai-chat" if cfg.client.endpoint_kind == "chat" else "openai",
        "label": cfg.label,
        "model_id": workload.model,
        "tokenizer_id": cfg.tokenizer_path,
        "num_prompts": len(rs),
        "request_rate": run.request_rate if math.isfinite(run.request_rate) else "inf",
        "burstiness": cfg.load.burstiness,
        "max_concurrency": cfg.load.max_concurrency,
        "duration": m.duration_s,
        "completed": m.completed,
        "failed": m.failed,
        "total_input_tokens": m.total_input,
        "total_output_tokens": m.total_output,
        "request_throughput": m.request_throughput,
        "request_goodput": m.request_goodput,
        "output_throughput": m.output_throughput,
        "total_token_throughput": m.total_token_throughput,
        "max_output_tokens_per_s": m.max_output_tokens_per_s,
        "max_concurrent_requests": m.max_concurrent_requests,
    }
    for name in cfg.report.percentile_metrics:
        s: Summary = getattr(m, name)
        result[f"mean_{name}_ms"] = s.mean
        result[f"median_{name}_ms"] = s.median
        result[f"std_{name}_ms"] = s.std
        for p, value in s.percentiles:
            result[f"p{percentile_word(p)}_{name}_ms"] = value
    result |= {
        "input_lens": run.input_lens,
        "output_lens": list(m.output_lens),
        "ttfts": [r.ttft_s for r in rs],
        "itls": [r.itl_s for r in rs],
        "latencies": [r.latency_s for r in rs],
        "start_times": [_finite(r.sent_s) for r in rs],
        "queue_times": [_finite(r.sent_s - r.dispatched_s) for r in rs],
        "errors": [r.error for r in rs],
        "generated_texts": [r.generated_text for r in rs],
        # additions: what makes a number reproducible and trustworthy
        "endpoint": cfg.client.endpoint,
        "dataset": cfg.dataset.kind,
        "prompt_format": cfg.dataset.prompt_format,
        "ignore_eos": cfg.client.ignore_eos,
        "seed": cfg.seed,
        "goodput_slos_ms": dict(cfg.report.goodput_slos_ms),
        "client_processes": run.health.num_processes,
        "client_send_lag_p99_ms": run.health.send_lag_p99_ms,
        "client_loop_lag_p99_ms": run.health.loop_lag_p99_ms,
        "client_cpu_util_max": run.health.cpu_util_max,
        "warnings": run.warnings,
    }
    return result


def write_json(path: str | Path, obj: Any) -> None:
    Path(path).write_text(json.dumps(obj, indent=2, allow_nan=False) + "\n")


CSV_COLUMNS = (
    "request_rate", "index", "success", "error", "http_status", "scheduled_s", "sent_s",
    "send_lag_ms", "queue_ms", "prompt_tokens", "server_prompt_tokens", "max_tokens",
    "output_tokens", "output_tokens_source", "num_chunks", "ttft_ms", "tpot_ms", "mean_itl_ms",
    "max_itl_ms", "e2el_ms", "finish_reason",
)  # fmt: skip


def write_csv(path: str | Path, workload: Workload, runs: Sequence[RunResult]) -> None:
    """One row per request of every run, failures included with their reason."""
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(CSV_COLUMNS)
        for run in runs:
            for req, r, n_in in zip(workload.requests, run.results, run.input_lens, strict=True):
                tpot = tpot_s(r)
                writer.writerow([
                    run.request_rate, r.index, int(r.success), r.error, r.http_status or "",
                    _fmt(r.scheduled_s), _fmt(r.sent_s), _ms(r.dispatched_s - r.scheduled_s),
                    _ms(r.sent_s - r.dispatched_s), n_in, _opt(r.server_prompt_tokens),
                    req.output_len, r.output_tokens,
                    "usage" if r.output_tokens_from_usage else "chunks", r.num_chunks,
                    _ms(r.ttft_s) if r.success else "", _ms(tpot) if tpot is not None else "",
                    _ms(sum(r.itl_s) / len(r.itl_s)) if r.itl_s else "",
                    _ms(max(r.itl_s)) if r.itl_s else "", _ms(r.latency_s),
                    r.finish_reason or "",
                ])  # fmt: skip


def sweep_table(runs: Sequence[RunResult]) -> str:
    """One line per rate: what the knee is read from."""
    from nori_jax.bench.sweep import sweep_point

    points = [sweep_point(r) for r in runs]
    head = (
        f"{'rate':>8} {'req/s':>8} {'total tok/s':>12} {'TTFT P50':>9} {'TTFT P99':>9} "
        f"{'TPOT P50':>9} {'TPOT P99':>9} {'failed':>6}"
    )
    lines = [" Rate sweep ".center(len(head), "="), head]
    for pt, run in zip(points, runs, strict=True):
        m = run.metrics
        lines.append(
            f"{pt.rate:>8g} {m.request_throughput:>8.2f} {pt.throughput:>12.1f} "
            f"{m.ttft.median:>9.1f} {pt.p99_ttft_ms:>9.1f} {m.tpot.median:>9.1f} "
            f"{pt.p99_tpot_ms:>9.1f} {m.failed:>6d}"
        )
    return "\n".join(lines)


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _fmt(x: float) -> str:
    return f"{x:.6f}" if math.isfinite(x) else ""


def _ms(x: float) -> str:
    return f"{x * 1e3:.3f}" if math.isfinite(x) else ""


def _opt(x: int | None) -> str | int:
    return "" if x is None else x
