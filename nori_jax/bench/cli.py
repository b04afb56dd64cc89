"""`nori-jax bench serve`: its flags, and the top level of a run or a sweep (docs/bench.md).

The engine's CLI registers it under `bench` with `add_bench_serve_parser`; `python -m
nori_jax.bench serve ...` runs it alone. Its HTTP client, progress bars and plots come with the
`bench` extra (`pip install 'nori-jax[bench]'`).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nori_jax.bench.config import ENDPOINTS, METRIC_NAMES, BenchConfig
from nori_jax.bench.workload import DATASETS, HelpFormatter, add_workload_args, workload_from_args

if TYPE_CHECKING:
    from nori_jax.bench.sweep import SweepConfig

BENCH_EXTRA = ("aiohttp", "tqdm", "matplotlib")
INTERRUPTED = 130  # the shell's code for a run ended by SIGINT
SWEEP_START_RATE = 1.0


def add_bench_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add `serve` to a subparsers object (of the `bench` group) and return its parser."""
    p = subparsers.add_parser(
        "serve",
        help="load-test an OpenAI-compatible server (this engine, vLLM, SGLang)",
        description="Streaming load generator with vLLM-compatible results; see docs/bench.md.",
        formatter_class=HelpFormatter,
    )
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root URL")
    g.add_argument("--endpoint", default=ENDPOINTS[0], choices=ENDPOINTS, help="OpenAI route")
    g.add_argument("--model", help="model name sent (default: the first of GET /v1/models)")
    g.add_argument("--api-key", help="sent as a Bearer token (default: $OPENAI_API_KEY, if set)")
    g.add_argument(
        "--header",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="extra HTTP headers (default: none)",
    )
    add_workload_args(p, DATASETS, "--seed", warmup=0)
    g = p.add_argument_group("prompts")
    g.add_argument(
        "--dataset-path",
        help='jsonl lines {"prompt": str|[int], "output_len": int?} (default: none)',
    )
    g.add_argument(
        "--tokenizer",
        help="HF tokenizer dir or .gguf file, for exact input lengths (default: the one the "
        "server's /v1/models card names: a local path, this engine's presets and embedded model, "
        "a model in the Hugging Face cache; else word estimates)",
    )
    g.add_argument(
        "--prompt-format",
        default="text",
        choices=("text", "token-ids"),
        help="token-ids: prompts as id lists (/v1/completions only)",
    )
    g = p.add_argument_group("requests")
    g.add_argument("--max-concurrency", type=int, help="cap on requests in flight (default: none)")
    g.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: true (default: off)")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature sent")
    g.add_argument(
        "--max-tokens-field",
        default="max_tokens",
        choices=("max_tokens", "max_completion_tokens"),
        help="the body field carrying the output length",
    )
    g.add_argument("--extra-body", default="{}", help="JSON object merged into every body")
    g.add_argument(
        "--request-timeout", type=float, default=600.0, help="seconds before a request fails"
    )
    g.add_argument("--num-client-processes", default="auto", help="auto: half the cores, at most 8")
    g = p.add_argument_group("results")
    g.add_argument(
        "--percentile-metrics", default=",".join(METRIC_NAMES), help="metrics with percentiles"
    )
    g.add_argument("--metric-percentiles", default="99", help="comma-separated, e.g. 50,90,99")
    g.add_argument(
        "--goodput",
        nargs="+",
        default=[],
        metavar="NAME:MS",
        help="SLOs, e.g. ttft:500 tpot:50 (default: none)",
    )
    g.add_argument("--result-json", help="vLLM-compatible result JSON (default: none)")
    g.add_argument("--result-csv", help="CSV, one row per request (default: none)")
    g.add_argument("--label", help="free-form label stored in the result JSON (default: none)")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bars (default: bars)")
    g = p.add_argument_group("sweep")
    g.add_argument(
        "--sweep", help="R1,R2,... or auto (doubling) (default: one run at --request-rate)"
    )
    g.add_argument(
        "--sweep-start-rate", type=float, default=SWEEP_START_RATE, help="first rate of auto"
    )
    g.add_argument("--sweep-max-steps", type=int, default=10, help="most runs of auto")
    g.add_argument(
        "--sweep-prompts",
        choices=("fresh", "same"),
        default="fresh",
        help="fresh: other tokens of the same lengths at each rate (no prefix-cache reuse)",
    )
    g.add_argument(
        "--knee-min-gain", type=float, default=0.5, help="knee: throughput gain below this share"
    )
    g.add_argument(
        "--knee-min-latency-rise", type=float, default=0.2, help="knee: and P99s rising this much"
    )
    g.add_argument(
        "--plot", help="sweep PNG (default: --result-json with .png, else bench_sweep.png)"
    )
    p.set_defaults(func=run_bench_serve)
    return p


def config_from_args(args: argparse.Namespace) -> tuple[BenchConfig, SweepConfig | None]:
    """The run's BenchConfig and its SweepConfig (None for one run); ValueError on bad flags."""
    from nori_jax.bench.run import default_num_processes
    from nori_jax.bench.sweep import SweepConfig

    headers = dict(_split(h, "=", "--header wants KEY=VALUE") for h in args.header)
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    if api_key:
        headers.setdefault("Authorization", f"Bearer {api_key}")
    try:
        extra_body = json.loads(args.extra_body)
    except json.JSONDecodeError as e:
        raise ValueError(f"--extra-body is not JSON ({e}): {args.extra_body!r}") from None
    if not isinstance(extra_body, dict):
        raise ValueError(f"--extra-body must be a JSON object, got {args.extra_body!r}")
    goodput = {}
    for text in args.goodput:
        name, value = _split(text, ":", "--goodput wants NAME:MS (e.g. ttft:500)")
        try:
            goodput[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput wants NAME:MS (e.g. ttft:500), got {text!r}") from None
    percentiles = _floats(args.metric_percentiles, "--metric-percentiles")
    if args.sweep and 99.0 not in percentiles:
        percentiles += (99.0,)  # the knee is defined on P99 latency
    workload = workload_from_args(args)
    auto = args.num_client_processes == "auto"
    if not auto and not args.num_client_processes.isdigit():
        raise ValueError(
            f"--num-client-processes wants auto or N, got {args.num_client_processes!r}"
        )
    processes = 0 if auto else int(args.num_client_processes)
    cfg = BenchConfig(
        base_url=args.base_url,
        workload=workload,
        endpoint=args.endpoint,
        model=args.model,
        headers=headers,
        request_timeout_s=args.request_timeout,
        num_processes=default_num_processes(workload.num_prompts) if auto else processes,
        max_concurrency=args.max_concurrency,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        max_tokens_field=args.max_tokens_field,
        extra_body=extra_body,
        tokenizer=args.tokenizer,
        prompt_format=args.prompt_format,
        percentile_metrics=tuple(m for m in args.percentile_metrics.split(",") if m),
        metric_percentiles=percentiles,
        goodput_slos_ms=goodput,
        label=args.label,
    )
    if not args.sweep:
        return cfg, None
    _refuse_flags_a_sweep_ignores(args)
    return cfg, SweepConfig(
        rates=None if args.sweep == "auto" else _floats(args.sweep, "--sweep (R1,R2,... or auto)"),
        start_rate=args.sweep_start_rate,
        max_steps=args.sweep_max_steps,
        min_gain=args.knee_min_gain,
        min_latency_rise=args.knee_min_latency_rise,
    )


def _refuse_flags_a_sweep_ignores(args: argparse.Namespace) -> None:
    """A flag that would have no effect is a mistake to say, not one to ignore silently."""
    if args.request_rate != math.inf:
        raise ValueError("--request-rate is not used by --sweep, which sets the rates itself")
    if args.sweep != "auto" and args.sweep_start_rate != SWEEP_START_RATE:
        raise ValueError("--sweep-start-rate is used by --sweep auto only, not a list of rates")


def _split(text: str, sep: str, usage: str) -> tuple[str, str]:
    key, found, value = text.partition(sep)
    if not found or not key:
        raise ValueError(f"{usage}, got {text!r}")
    return key, value


def _floats(text: str, flag: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{flag} wants numbers, got {text!r}") from None


def run_bench_serve(args: argparse.Namespace) -> int:
    """0 when some request succeeded, 1 when all failed, 2 on bad input, 130 on Ctrl-C."""
    missing = [name for name in BENCH_EXTRA if importlib.util.find_spec(name) is None]
    if missing:
        print(
            f"error: bench serve needs the bench extra (missing: {', '.join(missing)}): "
            "pip install 'nori-jax[bench]' (in a checkout: pip install -e '.[bench]')",
            file=sys.stderr,
        )
        return 2
    try:
        return _bench_serve(args)
    except KeyboardInterrupt:
        print("\nInterrupted (Ctrl-C)", file=sys.stderr)
        return INTERRUPTED


def _bench_serve(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from nori_jax.bench import report
    from nori_jax.bench.run import RunResult, fresh_prompts, prepare_workload, run_once
    from nori_jax.bench.sweep import knee_dict, knee_line, run_sweep

    try:
        cfg, sweep = config_from_args(args)
        workload = prepare_workload(cfg)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"Model: {workload.model}; tokenizer: {workload.tokenizer or 'none (word estimates)'}")
    runs_done = 0

    def run_at(rate: float) -> RunResult:
        nonlocal runs_done
        fresh = sweep is not None and args.sweep_prompts == "fresh" and runs_done > 0
        load = fresh_prompts(cfg, workload, runs_done) if fresh else workload
        runs_done += 1
        n = cfg.workload.num_prompts
        bar = tqdm(total=n, desc=f"{rate:g} req/s", disable=args.disable_tqdm, leave=False)
        try:
            run = run_once(cfg, load, rate, bar.update)
        finally:
            bar.close()
        print(report.load_header(cfg, rate))
        report.print_run(cfg, run, sys.stdout)
        return run

    if sweep is None:
        run = run_at(cfg.workload.request_rate)
        runs = [run]
        if args.result_json:
            report.write_json(args.result_json, report.result_dict(cfg, workload, run))
    else:
        from nori_jax.bench.plot import plot_sweep

        runs, knee, stop_reason = run_sweep(sweep, run_at)
        print(report.sweep_table(runs))
        print(knee_line(runs, knee, stop_reason))
        json_path = args.result_json and Path(args.result_json)
        plot_path = args.plot or (json_path.with_suffix(".png") if json_path else "bench_sweep.png")
        plot_sweep(runs, knee, plot_path, f"{workload.model} {cfg.endpoint}")
        print(f"Plot: {plot_path}")
        if json_path:
            report.write_json(
                json_path,
                {
                    "knee_request_rate": knee.rate if knee else None,
                    "knee": knee_dict(knee),
                    "stop_reason": stop_reason,
                    "request_rates": [r.request_rate for r in runs],
                    "runs": [report.result_dict(cfg, workload, r) for r in runs],
                },
            )
    if args.result_csv:
        report.write_csv(args.result_csv, workload, runs)
    if runs[-1].interrupted:
        return INTERRUPTED
    return 0 if any(r.metrics["completed"] for r in runs) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nori_jax.bench")
    add_bench_serve_parser(parser.add_subparsers(dest="bench_command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)
