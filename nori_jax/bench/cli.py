"""`nori-jax bench serve`: argument parsing and the top level of a run or a sweep.

The engine's CLI registers this under its `bench` group with `add_bench_serve_parser`; the
parser's `func` default is `run_bench_serve`. `python -m nori_jax.bench serve ...` runs it alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nori_jax.bench.config import (
    DEFAULT_INPUT_LENGTHS,
    DEFAULT_OUTPUT_LENGTHS,
    ENDPOINTS,
    METRIC_NAMES,
    BenchConfig,
    ClientConfig,
    DatasetConfig,
    LoadConfig,
    LognormalLengths,
    ReportConfig,
)
from nori_jax.bench.knee import DEFAULT_MIN_GAIN, DEFAULT_MIN_LATENCY_RISE, KneeCriteria

if TYPE_CHECKING:  # the heavy modules load when a run starts, not when the CLI is built
    from nori_jax.bench.runner import Workload
    from nori_jax.bench.sweep import SweepConfig


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except unset ones (None, empty) that the help text already explains."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False or action.default == []:
            return action.help or ""
        return (super()._get_help_string(action) or "") if action.help else ""


def add_bench_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add `serve` to a subparsers object (of the `bench` group) and return its parser."""
    p = subparsers.add_parser(
        "serve",
        help="load-test an OpenAI-compatible server (this engine, vLLM, SGLang)",
        description="Streaming load generator; see docs/bench.md for definitions.",
        formatter_class=_HelpFormatter,
    )
    add_serve_arguments(p)
    p.set_defaults(func=run_bench_serve)
    return p


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root URL")
    g.add_argument(
        "--endpoint", default="/v1/completions", choices=sorted(ENDPOINTS), help="OpenAI route"
    )
    g.add_argument("--model", help="model name to send; unset: the first of GET /v1/models")
    # read from the environment when the run starts, not here: --help prints defaults
    g.add_argument("--api-key", help="sent as a Bearer token; unset: $OPENAI_API_KEY if set")
    g.add_argument(
        "--header", nargs="*", default=[], metavar="KEY=VALUE", help="extra HTTP headers"
    )

    g = p.add_argument_group("dataset")
    g.add_argument(
        "--dataset",
        default="lognormal",
        choices=("lognormal", "fixed", "jsonl"),
        help="where prompts and lengths come from",
    )
    g.add_argument("--num-prompts", type=int, default=1000, help="requests in the run")
    for side, d in (("input", DEFAULT_INPUT_LENGTHS), ("output", DEFAULT_OUTPUT_LENGTHS)):
        g.add_argument(f"--{side}-mu", type=float, default=d.mu, help=f"lognormal {side} mu")
        g.add_argument(
            f"--{side}-sigma", type=float, default=d.sigma, help=f"lognormal {side} sigma"
        )
        g.add_argument(
            f"--{side}-min", type=int, default=d.min_len, help=f"lower clip of {side} lengths"
        )
        g.add_argument(
            f"--{side}-max", type=int, default=d.max_len, help=f"upper clip of {side} lengths"
        )
    g.add_argument("--input-len", type=int, default=1024, help="fixed input length")
    g.add_argument(
        "--output-len",
        type=int,
        default=128,
        help="fixed output length; also jsonl lines without one",
    )
    g.add_argument("--dataset-path", help='jsonl: {"prompt": str|[int], "output_len": int?}')
    g.add_argument(
        "--tokenizer",
        help="HF tokenizer dir (tokenizer.json) or .gguf file, for exact input lengths",
    )
    g.add_argument(
        "--prompt-format",
        default="text",
        choices=("text", "token-ids"),
        help="token-ids: prompts as id lists (/v1/completions only)",
    )
    g.add_argument("--seed", type=int, default=0, help="fixes lengths, prompts and arrivals")

    g = p.add_argument_group("load")
    g.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="req/s with gamma/Poisson gaps; inf sends all at t=0",
    )
    g.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the gaps: 1 Poisson, <1 burstier, >1 smoother",
    )
    g.add_argument("--max-concurrency", type=int, help="cap on requests in flight")
    g.add_argument(
        "--warmup-requests",
        type=int,
        default=0,
        help="sent (all at once) before the run; excluded from results",
    )
    g.add_argument(
        "--ignore-eos",
        action="store_true",
        help="send ignore_eos: true so every request produces max_tokens",
    )
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature sent")
    g.add_argument(
        "--max-tokens-field", default="max_tokens", choices=("max_tokens", "max_completion_tokens")
    )
    g.add_argument(
        "--extra-body",
        default="{}",
        help="JSON object merged into every request body",
    )
    g.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="seconds before a request counts as failed",
    )
    g.add_argument(
        "--num-client-processes",
        default="auto",
        help="client processes sending and parsing streams; auto: half the cores, at most 8",
    )

    g = p.add_argument_group("results")
    g.add_argument(
        "--percentile-metrics",
        default=",".join(METRIC_NAMES),
        help="metrics to report percentiles of: ttft,tpot,itl,e2el",
    )
    g.add_argument("--metric-percentiles", default="99", help="comma-separated, e.g. 50,90,99")
    g.add_argument(
        "--goodput",
        nargs="+",
        default=[],
        metavar="NAME:MS",
        help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:20000",
    )
    g.add_argument("--result-json", help="write vLLM-compatible result JSON here")
    g.add_argument("--result-csv", help="write one row per request here")
    g.add_argument("--label", help="free-form label stored in the result JSON")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bars")

    g = p.add_argument_group("sweep")
    g.add_argument("--sweep", help="R1,R2,... or auto (doubling from --sweep-start-rate)")
    g.add_argument(
        "--sweep-start-rate", type=float, default=1.0, help="first rate of --sweep auto (req/s)"
    )
    g.add_argument("--sweep-max-steps", type=int, default=10, help="most runs of --sweep auto")
    g.add_argument(
        "--sweep-prompts",
        choices=["fresh", "same"],
        default="fresh",
        help="fresh: every rate sends the same lengths with other tokens (a prefix-caching "
        "server cannot reuse an earlier rate's prompts); same: identical prompts at every rate",
    )
    g.add_argument(
        "--knee-min-gain",
        type=float,
        default=DEFAULT_MIN_GAIN,
        help="knee: throughput gain below this share of the offered rate increase",
    )
    g.add_argument(
        "--knee-min-latency-rise",
        type=float,
        default=DEFAULT_MIN_LATENCY_RISE,
        help="knee: and P99 TTFT or TPOT rising by at least this fraction",
    )
    g.add_argument(
        "--plot", help="sweep plot PNG; unset: --result-json with .png, else bench_sweep.png"
    )


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    headers = dict(_key_value(h) for h in args.header)
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    if api_key:
        headers.setdefault("Authorization", f"Bearer {api_key}")
    extra_body = _json_object(args.extra_body)
    if args.num_client_processes == "auto":
        from nori_jax.bench.runner import default_num_processes

        processes = default_num_processes(args.num_prompts)
    else:
        processes = int(args.num_client_processes)
    percentiles = tuple(float(p) for p in args.metric_percentiles.split(",") if p)
    if args.sweep and 99.0 not in percentiles:
        percentiles += (99.0,)  # the knee is defined on P99 latency
    return BenchConfig(
        client=ClientConfig(
            base_url=args.base_url,
            endpoint=args.endpoint,
            model=args.model,
            headers=headers,
            request_timeout_s=args.request_timeout,
            num_processes=processes,
            ignore_eos=args.ignore_eos,
            temperature=args.temperature,
            max_tokens_field=args.max_tokens_field,
            extra_body=extra_body,
        ),
        dataset=DatasetConfig(
            kind=args.dataset,
            num_prompts=args.num_prompts,
            input_lengths=LognormalLengths(
                args.input_mu, args.input_sigma, args.input_min, args.input_max
            ),
            output_lengths=LognormalLengths(
                args.output_mu, args.output_sigma, args.output_min, args.output_max
            ),
            input_len=args.input_len,
            output_len=args.output_len,
            path=args.dataset_path,
            prompt_format=args.prompt_format,
        ),
        load=LoadConfig(args.request_rate, args.burstiness, args.max_concurrency),
        report=ReportConfig(
            percentile_metrics=tuple(m for m in args.percentile_metrics.split(",") if m),
            metric_percentiles=percentiles,
            goodput_slos_ms=dict(_goodput(g) for g in args.goodput),
        ),
        tokenizer_path=args.tokenizer,
        warmup_requests=args.warmup_requests,
        seed=args.seed,
        label=args.label,
        show_progress=not args.disable_tqdm,
    )


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ValueError(f"--header wants KEY=VALUE, got {text!r}")
    return key, value


def _goodput(text: str) -> tuple[str, float]:
    name, sep, value = text.partition(":")
    try:
        if not sep:
            raise ValueError
        return name, float(value)
    except ValueError:
        raise ValueError(f"--goodput wants NAME:MS (e.g. ttft:500), got {text!r}") from None


def _json_object(text: str) -> dict[str, Any]:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--extra-body is not JSON ({e}): {text!r}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"--extra-body must be a JSON object, got {text!r}")
    return obj


def run_bench_serve(args: argparse.Namespace) -> int:
    """Run `bench serve`; 0 when some request succeeded, 1 when all failed, 2 on bad input."""
    from nori_jax.bench.runner import prepare_workload
    from nori_jax.bench.sweep import SweepConfig

    try:
        cfg = config_from_args(args)
        sweep = None
        if args.sweep:
            rates = None if args.sweep == "auto" else _rates(args.sweep)
            criteria = KneeCriteria(args.knee_min_gain, args.knee_min_latency_rise)
            sweep = SweepConfig(
                rates=rates,
                start_rate=args.sweep_start_rate,
                max_steps=args.sweep_max_steps,
                criteria=criteria,
            )
        workload = prepare_workload(cfg)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if sweep is None:
        return _single(cfg, workload, args)
    return _sweep(cfg, workload, sweep, args)


def _rates(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(r) for r in text.split(",") if r.strip())
    except ValueError:
        raise ValueError(f"--sweep wants R1,R2,... or auto, got {text!r}") from None


def _progress_bar(cfg: BenchConfig, desc: str, **kw: Any) -> tuple[Callable[[int], None], Any]:
    from tqdm import tqdm

    bar = tqdm(total=cfg.dataset.num_prompts, desc=desc, disable=not cfg.show_progress, **kw)
    return bar.update, bar


def _single(cfg: BenchConfig, workload: Workload, args: argparse.Namespace) -> int:
    from nori_jax.bench.report import load_header, print_run, result_dict, write_csv, write_json
    from nori_jax.bench.runner import run_once

    print(load_header(cfg, cfg.load.request_rate))
    update, bar = _progress_bar(cfg, "requests")
    try:
        run = run_once(cfg, workload, progress=update)
    finally:
        bar.close()
    print_run(cfg, run, sys.stdout)
    if args.result_json:
        write_json(args.result_json, result_dict(cfg, workload, run))
    if args.result_csv:
        write_csv(args.result_csv, workload, [run])
    return 0 if run.metrics.completed else 1


def _sweep(
    cfg: BenchConfig, workload: Workload, sweep: SweepConfig, args: argparse.Namespace
) -> int:
    from tqdm import tqdm

    from nori_jax.bench.plot import plot_sweep
    from nori_jax.bench.report import (
        load_header,
        print_run,
        result_dict,
        sweep_table,
        write_csv,
        write_json,
    )
    from nori_jax.bench.runner import RunResult, prepare_workload, run_once
    from nori_jax.bench.sweep import run_sweep

    outer = tqdm(total=sweep.num_steps, desc="sweep", disable=not cfg.show_progress, position=0)

    rates_run = 0

    def run_at(rate: float) -> RunResult:
        nonlocal rates_run
        fresh = args.sweep_prompts == "fresh" and rates_run > 0
        load = prepare_workload(cfg, rates_run, workload.model) if fresh else workload
        rates_run += 1
        update, bar = _progress_bar(cfg, f"{rate:g} req/s", position=1, leave=False)
        try:
            run = run_once(cfg, load, request_rate=rate, progress=update)
        finally:
            bar.close()
        outer.update(1)
        text = _capture(lambda out: print_run(cfg, run, out))
        tqdm.write(load_header(cfg, rate) + "\n" + text, file=sys.stdout)
        return run

    try:
        outcome = run_sweep(sweep, run_at)
    finally:
        outer.close()
    knee = outcome.knee
    print(sweep_table(outcome.runs))
    if knee is None:
        print(f"Knee: not found within the tested rates ({outcome.stop_reason})")
    else:
        print(
            f"Knee: {knee.rate:g} req/s (throughput efficiency {knee.efficiency:.2f} and P99 "
            f"TTFT {knee.ttft_rise:+.0%} / TPOT {knee.tpot_rise:+.0%} at {knee.next_rate:g} req/s)"
        )
    plot_path = args.plot or (
        str(Path(args.result_json).with_suffix(".png")) if args.result_json else "bench_sweep.png"
    )
    plot_sweep(outcome.runs, knee, plot_path, title=f"{workload.model} {cfg.client.endpoint}")
    print(f"Plot: {plot_path}")
    if args.result_json:
        write_json(
            args.result_json,
            {
                "knee_request_rate": knee.rate if knee else None,
                "knee": dataclasses.asdict(knee) if knee else None,
                "stop_reason": outcome.stop_reason,
                "request_rates": [r.request_rate for r in outcome.runs],
                "runs": [result_dict(cfg, workload, r) for r in outcome.runs],
            },
        )
    if args.result_csv:
        write_csv(args.result_csv, workload, outcome.runs)
    return 0 if any(r.metrics.completed for r in outcome.runs) else 1


def _capture(fn: Callable[[Any], None]) -> str:
    import io

    buf = io.StringIO()
    fn(buf)
    return buf.getvalue().rstrip("\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nori_jax.bench")
    sub = parser.add_subparsers(dest="bench_command", required=True)
    add_bench_serve_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)
