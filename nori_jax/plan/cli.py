"""`nori-jax plan`: calibrate, simulate, sweep, size (docs/planning.md).

Registered by the engine's CLI through `add_plan_parser`. Building the parser imports nothing
heavy; the commands import the simulator when they run. The simulator reports with `bench
serve`'s metric code, whose modules import the bench extra's HTTP client, so the commands need
`pip install 'nori-jax[bench]'` (and its matplotlib for --plot); `plan calibrate` needs a device
the engine runs on.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import json
import math
import sys
from pathlib import Path
from typing import Any

from nori_jax.bench.workload import HelpFormatter, add_workload_args, workload_from_args

_NEEDS = ("aiohttp",)  # imported by nori_jax.bench.client, which the metrics module imports


PLAN_HELP = "capacity planning: the scheduler in simulated time over a calibrated step model"


def add_plan_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("plan", help=PLAN_HELP)
    add_plan_args(p)
    return p


def add_plan_args(p: argparse.ArgumentParser) -> None:
    """The `plan` command's sub-commands, on a parser made for it (nori_jax/cli.py)."""
    p.description = (
        "Predict throughput, latency, the knee and the GPUs a workload needs; see docs/planning.md."
    )
    from nori_jax.cli_parsing import DefaultsHelpFormatter

    plan_sub = p.add_subparsers(
        dest="plan_command",
        required=True,
        parser_class=functools.partial(
            argparse.ArgumentParser, formatter_class=DefaultsHelpFormatter
        ),
    )
    _add_calibrate(plan_sub)
    _add_simulate(plan_sub)
    _add_sweep(plan_sub)
    _add_size(plan_sub)


def _scheduler_default(name: str) -> str:
    """A lever the calibration does not record: unset, the scheduler's default holds."""
    from nori_jax.core.scheduler_config import SchedulerConfig

    default = next(f.default for f in dataclasses.fields(SchedulerConfig) if f.name == name)
    return f" (default: the scheduler's, {default:g})"


# ---- flags ----------------------------------------------------------------------------------


def _add_calibration_args(p: argparse.ArgumentParser, many: bool = False) -> None:
    g = p.add_argument_group("calibration")
    g.add_argument(
        "--calibration",
        action="append",
        metavar="FILE",
        help="calibration YAML (repeatable for size: one per mesh layout); default: the one in "
        "--calibration-dir matching --model/--dtype/--kv-dtype/--device/--tp",
    )
    from nori_jax.plan.calibration import CALIBRATION_DIR

    g.add_argument("--calibration-dir", default=str(CALIBRATION_DIR), help="where to look")
    # Each left unset matches any calibration: it selects, it sets nothing.
    g.add_argument("--model", help="model shape preset the calibration must be of (default: any)")
    g.add_argument("--dtype", help="weights' dtype, e.g. bfloat16 or float32 (default: any)")
    g.add_argument(
        "--kv-dtype",
        help="KV pages' dtype: bfloat16, fp8 where calibrated (default: any; of several that "
        "match, the one in the weights' dtype)",
    )
    g.add_argument("--device", help="accelerator, e.g. nvidia-h200 or cpu (default: any)")
    g.add_argument(
        "--tp",
        type=int,
        help="tensor-parallel devices per replica"
        + (" (default: every calibrated layout)" if many else " (default: any)"),
    )


def _add_workload(p: argparse.ArgumentParser) -> None:
    add_workload_args(p, ("lognormal", "fixed"), "--seed", warmup=0)
    g = p.add_argument_group("workload shapers (as bench offline)")
    g.add_argument("--shared-prefix-len", type=int, default=0, help="prompt start shared by all")
    g.add_argument("--long-prompts", type=int, default=0, help="very long prompts mixed in")
    g.add_argument("--long-len", type=int, default=6000, help="length of those long prompts")


def _add_whatif(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("what-if (default: the calibrated engine's, else the scheduler's)")
    calibrated = " (default: the calibrated engine's)"
    g.add_argument(
        "--page-size", type=int, help="KV page size (same KV memory, other pages)" + calibrated
    )
    g.add_argument("--num-pages", type=int, help="KV pages (default: the calibrated KV memory)")
    g.add_argument(
        "--kv-headroom",
        type=float,
        help="share of pages admission keeps free" + _scheduler_default("kv_headroom"),
    )
    g.add_argument("--max-num-seqs", type=int, help="running sequences" + calibrated)
    g.add_argument(
        "--max-num-batched-tokens", type=int, help="token (chunk) budget per step" + calibrated
    )
    g.add_argument("--max-model-len", type=int, help="context limit of a request" + calibrated)
    g.add_argument("--no-prefix-caching", action="store_true", help="turn prefix caching off")
    g.add_argument(
        "--long-prefill-threshold",
        type=int,
        help="isolate prompts this long (0, the default: no isolation)",
    )
    g.add_argument(
        "--long-prefill-token-share",
        type=float,
        help="share of a step's budget for long prompts"
        + _scheduler_default("long_prefill_token_share"),
    )
    g.add_argument(
        "--max-num-long-prefills",
        type=int,
        help="long prompts prefilled at once" + _scheduler_default("max_num_long_prefills"),
    )
    g.add_argument(
        "--max-num-waiting", type=int, help="queue bound (beyond: 429, failed; default: none)"
    )
    g.add_argument("--sync-scheduling", action="store_true", help="no host/device overlap")
    g.add_argument(
        "--num-scheduler-steps",
        type=int,
        help="multi-step decode: decode steps per launch once nothing waits (the engine flag)"
        + _scheduler_default("num_scheduler_steps"),
    )
    g.add_argument(
        "--multi-step-max-seqs",
        type=int,
        help="the most running sequences of a multi-step launch"
        + _scheduler_default("multi_step_max_seqs"),
    )
    g.add_argument(
        "--frontend-us-per-token",
        type=float,
        default=0.0,
        help="API server process cost per streamed token (0: not modelled)",
    )
    g.add_argument(
        "--frontend-ms-per-step", type=float, default=0.0, help="and per engine step's output"
    )
    g.add_argument(
        "--frontend-ms-per-request",
        type=float,
        default=0.0,
        help="API server process cost of a request on arrival, before the core sees it "
        "(api_server_bench.py --output-len 1; 0: not modelled)",
    )
    g.add_argument(
        "--frontend-latency-ms",
        type=float,
        default=0.0,
        help="fixed latency of the way in and out (HTTP, sockets) added to every token: a "
        "served sweep's client mean TTFT less its server_mean_ttft_ms",
    )
    g.add_argument(
        "--frontend-servers",
        type=int,
        default=1,
        help="API server processes (serve --api-server-count), each paying the frontend costs "
        "of its own requests; also picks the calibration's engine-core send cost for that many",
    )
    g.add_argument(
        "--core-io-us-per-step",
        type=float,
        help="the engine-core process's send path per step (default: the calibration's, for "
        "--frontend-servers API servers; 0 where it has none)",
    )
    g.add_argument(
        "--core-io-us-per-row",
        type=float,
        help="and per token the step delivers (default: likewise the calibration's)",
    )
    g.add_argument(
        "--disaggregate",
        metavar="P:D",
        help="prefill on P replicas, decode on D, the KV moved between them (default: off)",
    )
    g.add_argument(
        "--kv-transfer-gbps",
        type=float,
        help="KV transfer bandwidth in GB/s (default: the calibration's measured one)",
    )
    g.add_argument(
        "--kv-transfer-latency-ms",
        type=float,
        help="fixed cost of one KV transfer (default: the calibration's; 0 where it has none)",
    )


def _add_results(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("results")
    g.add_argument(
        "--percentile-metrics", default="ttft,tpot,itl,e2el", help="metrics with percentiles"
    )
    g.add_argument("--metric-percentiles", default="99", help="comma-separated, e.g. 50,90,99")
    g.add_argument(
        "--goodput",
        nargs="+",
        default=[],
        metavar="NAME:MS",
        help="SLOs, e.g. ttft:500 tpot:50 (default: none)",
    )
    g.add_argument("--result-json", help="write the result here (default: none)")


def _add_common(p: argparse.ArgumentParser, many: bool = False) -> None:
    _add_calibration_args(p, many)
    _add_workload(p)
    _add_whatif(p)
    _add_results(p)


def _add_calibrate(sub: Any) -> None:
    from nori_jax.engine_args import add_engine_args

    p = sub.add_parser(
        "calibrate",
        help="record step profiles on this machine's engine and fit the step model",
        formatter_class=HelpFormatter,
    )
    add_engine_args(p)
    g = p.add_argument_group("profiles")
    g.add_argument(
        "--batches", default="1,16,64,256,1024", help="decode batch sizes (up to max_num_seqs)"
    )
    g.add_argument("--contexts", default="256,1024,4096", help="decode context lengths")
    g.add_argument("--prefill-lens", default="128,1024,4096,8000", help="prompts prefilled")
    g.add_argument(
        "--mixed-batch",
        default="32,256,1024",
        help="decode batches run beside the prompts, each at most max_num_seqs - 1 (0: none); "
        "the mixed steps fit the device model's mixed_decode_kv_tokens term",
    )
    g.add_argument("--steps", type=int, default=8, help="timed decode steps per shape")
    g.add_argument(
        "--out", help="YAML file or directory/ to write (default: configs/calibration/<key>.yaml)"
    )
    p.set_defaults(func=_calibrate)


def _add_simulate(sub: Any) -> None:
    p = sub.add_parser(
        "simulate", help="one simulated bench serve run", formatter_class=HelpFormatter
    )
    _add_common(p)
    p.set_defaults(func=_simulate)


def _add_sweep(sub: Any) -> None:
    p = sub.add_parser(
        "sweep", help="a simulated rate sweep and its knee", formatter_class=HelpFormatter
    )
    _add_common(p)
    g = p.add_argument_group("sweep")
    g.add_argument("--sweep", help="R1,R2,... or auto (default: the measured rates, else auto)")
    g.add_argument(
        "--sweep-start-rate",
        type=float,
        help="first rate of auto (default: an eighth of the rate served with every request "
        "queued at once)",
    )
    g.add_argument("--sweep-max-steps", type=int, default=12, help="most runs of auto")
    g.add_argument(
        "--knee-min-gain", type=float, default=0.5, help="knee: throughput gain below this share"
    )
    g.add_argument(
        "--knee-min-latency-rise",
        type=float,
        default=0.2,
        help="knee: P99 latency rising by more than this share",
    )
    g.add_argument(
        "--measured",
        help="a bench serve sweep JSON to compare with and plot beside (default: none)",
    )
    g.add_argument(
        "--plot", help="PNG of the sweep (needs matplotlib: the bench extra; default: none)"
    )
    p.set_defaults(func=_sweep)


def _add_size(sub: Any) -> None:
    p = sub.add_parser(
        "size",
        help="replicas (and GPUs) that serve a rate within SLOs, and the cost per token",
        formatter_class=HelpFormatter,
    )
    _add_common(p, many=True)
    g = p.add_argument_group("sizing")
    g.add_argument("--target-rate", type=float, required=True, help="req/s to serve")
    g.add_argument(
        "--slo", nargs="+", required=True, metavar="NAME:MS", help="e.g. ttft:500 tpot:50"
    )
    g.add_argument("--slo-percentile", type=float, default=99.0, help="percentile the SLOs bound")
    g.add_argument("--gpu-hour-price", type=float, help="price of one GPU-hour (default: no cost)")
    g.add_argument(
        "--search-start-rate",
        type=float,
        help="the ramp's first rate (default: an eighth of the rate served with every request "
        "queued at once)",
    )
    g.add_argument("--sweep-max-steps", type=int, default=12, help="most doublings of the ramp")
    g.add_argument(
        "--knee-min-gain", type=float, default=0.5, help="knee: throughput gain below this share"
    )
    g.add_argument(
        "--knee-min-latency-rise",
        type=float,
        default=0.2,
        help="knee: P99 latency rising by more than this share",
    )
    p.set_defaults(func=_size)


# ---- parsing ---------------------------------------------------------------------------------


def _floats(text: str, flag: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{flag} wants comma-separated numbers, got {text!r}") from None


def _ints(text: str, flag: str) -> tuple[int, ...]:
    values = _floats(text, flag)
    if any(v != int(v) for v in values):
        raise ValueError(f"{flag} wants whole numbers, got {text!r}")
    return tuple(int(v) for v in values)


def _bounds(texts: list[str], flag: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for text in texts:
        name, sep, value = text.partition(":")
        try:
            bound = float(value)
        except ValueError:
            sep = ""
        if not sep or not name:
            raise ValueError(f"{flag} wants NAME:MS (e.g. ttft:500), got {text!r}")
        if name in out:
            raise ValueError(
                f"{flag} names {name} more than once ({name}:{out[name]:g} and {text}): give "
                "each metric one bound"
            )
        out[name] = bound
    return out


def _check_output(path: str | None, flag: str) -> None:
    """Refuse, before any simulating, an output path that cannot be written as a file."""
    if path is None:
        return
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{flag} {path} is a directory: give a file path")
    if not p.parent.is_dir():
        raise ValueError(f"{flag} {path}: directory {str(p.parent)!r} does not exist")


def _has_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def _plot_path(path: str) -> str:
    """The file matplotlib's savefig writes for `path`: a name without a suffix gets .png."""
    return path if Path(path).suffix else path + ".png"


def _query(args: argparse.Namespace):
    from nori_jax.plan.calibration import CalibrationQuery

    return CalibrationQuery(args.model, args.dtype, args.kv_dtype, args.device, args.tp)


def _calibrations(args: argparse.Namespace, many: bool = False):
    from nori_jax.plan.calibration import find_calibration, find_calibrations

    query = _query(args)
    if args.calibration:
        if len(args.calibration) > 1 and not many:
            raise ValueError("give one --calibration (several are for plan size)")
        return [c for path in args.calibration for c in find_calibrations(query, path)]
    if many:
        return find_calibrations(query, directory=args.calibration_dir)
    return [find_calibration(query, directory=args.calibration_dir)]


def _settings(args: argparse.Namespace, extra_percentiles: tuple[float, ...] = ()):
    from nori_jax.bench.offline import OfflineConfig
    from nori_jax.plan.planner import PlanSettings
    from nori_jax.plan.simulator import Frontend
    from nori_jax.plan.whatif import WhatIf

    whatif = WhatIf(
        page_size=args.page_size,
        num_pages=args.num_pages,
        kv_headroom=args.kv_headroom,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=False if args.no_prefix_caching else None,
        long_prefill_threshold=args.long_prefill_threshold,
        long_prefill_token_share=args.long_prefill_token_share,
        max_num_long_prefills=args.max_num_long_prefills,
        max_num_waiting=args.max_num_waiting,
        async_scheduling=False if args.sync_scheduling else None,
        num_scheduler_steps=args.num_scheduler_steps,
        multi_step_max_seqs=args.multi_step_max_seqs,
    )
    disaggregate = None
    if args.disaggregate:
        p, sep, d = args.disaggregate.partition(":")
        if not (sep and p.isdigit() and d.isdigit()):
            raise ValueError(f"--disaggregate wants P:D (e.g. 1:3), got {args.disaggregate!r}")
        disaggregate = (int(p), int(d))
    # Each of a pair left unset is the calibration's (the Planner fills it in).
    gbps = _non_negative(args.kv_transfer_gbps, "--kv-transfer-gbps", positive=True)
    latency_ms = _non_negative(args.kv_transfer_latency_ms, "--kv-transfer-latency-ms")
    step_us = _non_negative(args.core_io_us_per_step, "--core-io-us-per-step")
    row_us = _non_negative(args.core_io_us_per_row, "--core-io-us-per-row")
    scaled = lambda v, unit: None if v is None else v * unit  # noqa: E731
    percentiles = _floats(args.metric_percentiles, "--metric-percentiles")
    percentiles += tuple(p for p in (99.0, *extra_percentiles) if p not in percentiles)
    return PlanSettings(
        shaping=OfflineConfig(
            workload_from_args(args), args.shared_prefix_len, args.long_prompts, args.long_len
        ),
        whatif=whatif,
        percentiles=percentiles,
        goodput_slos_ms=_bounds(args.goodput, "--goodput"),
        frontend=Frontend(
            args.frontend_ms_per_step / 1e3,
            args.frontend_us_per_token / 1e6,
            args.frontend_servers,
            args.frontend_latency_ms / 1e3,
            args.frontend_ms_per_request / 1e3,
        ),
        core_io_parts=(scaled(step_us, 1e-6), scaled(row_us, 1e-6)),
        disaggregate=disaggregate,
        kv_transfer_parts=(scaled(gbps, 1e9), scaled(latency_ms, 1e-3)),
    )


def _non_negative(value: float | None, flag: str, positive: bool = False) -> float | None:
    if value is None:
        return None
    if not (math.isfinite(value) and (value > 0 if positive else value >= 0)):
        raise ValueError(f"{flag} must be finite and {'> 0' if positive else '>= 0'}, got {value}")
    return value


def _bench_config(args: argparse.Namespace, settings):
    """`bench serve`'s config, only to print a run as bench serve prints it."""
    from nori_jax.bench.config import BenchConfig

    return BenchConfig(
        base_url="http://simulated",
        workload=settings.shaping.workload,
        percentile_metrics=tuple(m for m in args.percentile_metrics.split(",") if m),
        metric_percentiles=settings.percentiles,
        goodput_slos_ms=settings.goodput_slos_ms,
    )


def _missing_extra() -> list[str]:
    return [name for name in _NEEDS if importlib.util.find_spec(name) is None]


def _run(fn, args: argparse.Namespace) -> int:
    missing = _missing_extra()
    if missing:
        print(
            f"error: nori-jax plan reports with bench serve's metrics, whose modules need the "
            f"bench extra (missing: {', '.join(missing)}): pip install 'nori-jax[bench]'",
            file=sys.stderr,
        )
        return 2
    try:
        return fn(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _write_json(path: str, obj: Any) -> None:
    Path(path).write_text(json.dumps(_finite_only(obj), indent=2, allow_nan=False) + "\n")


def _finite_only(x: Any) -> Any:
    """inf and NaN (a knee's latency rise from 0, say) as null: JSON has neither."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite_only(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite_only(v) for v in x]
    return x


def _finite(x: float) -> float | str:
    return x if math.isfinite(x) else "inf"


def _header(planner) -> None:
    cal = planner.cal
    e = planner.engine
    s = e.scheduler
    print(f"Calibration: {cal.key.describe()} ({cal.path})")
    print(f"  {cal.source}")
    print(
        f"Simulated engine: page {s.page_size}, {e.num_pages} KV pages, {s.max_num_seqs} "
        f"sequences, {s.max_num_batched_tokens} tokens per step, headroom {s.kv_headroom:g}, "
        f"prefix caching {'on' if s.enable_prefix_caching else 'off'}, long-prompt isolation "
        f"{s.long_prefill_threshold or 'off'}, {'overlapped' if e.async_scheduling else 'sync'} "
        "scheduling"
        + (f"; disaggregated {planner.settings.disaggregate[0]}:{planner.settings.disaggregate[1]}"
           if planner.settings.disaggregate else "")
    )  # fmt: skip
    io, servers = planner.core_io, planner.settings.frontend.servers
    print(
        f"Engine-core send path ({servers} API server{'s' if servers > 1 else ''}): "
        + (f"{1e6 * io.step_s:.1f} us per step + {1e6 * io.row_s:.3f} us per token"
           if io.enabled else "not modelled (none calibrated for that many, or given 0)")
    )  # fmt: skip
    for w in planner.warnings:
        print(f"WARNING: {w}")


def _start_rate(planner, needed: bool) -> float:
    """An eighth of the request rate served with every request queued at once: a ramp from
    there reaches the knee in a few doublings, without the long runs of rates far below it."""
    if not needed:
        return 1.0  # unused: the sweep has its rates
    served = planner.run_at(math.inf).run.metrics["request_throughput"]
    start = float(f"{served / 8:.2g}")
    print(f"Ramp from {start:g} req/s (an eighth of {served:.3g} req/s with all queued at once)")
    return start


def _summary_line(summary: dict[str, Any]) -> str:
    parts = []
    for k, v in summary.items():
        parts.append(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}")
    return "Simulated: " + ", ".join(parts)


def _calibration_dict(cal) -> dict[str, Any]:
    return {"key": dataclasses.asdict(cal.key), "path": cal.path, "source": cal.source}


def _run_dict(outcome) -> dict[str, Any]:
    run = outcome.run
    return {
        "request_rate": _finite(run.request_rate),
        **{k: v for k, v in run.metrics.items() if k != "output_lens"},
        "simulated": outcome.summary,
        "warnings": run.warnings,
    }


# ---- commands --------------------------------------------------------------------------------


def _calibrate(args: argparse.Namespace) -> int:
    try:
        from nori_jax.engine_args import engine_config_from_args
        from nori_jax.plan.calibrate import ProfileGrid, calibrate, mixed_report, write
        from nori_jax.plan.step_model import MIXED_KV_TERM

        config = engine_config_from_args(args)
        grid = ProfileGrid(
            _ints(args.batches, "--batches"),
            _ints(args.contexts, "--contexts"),
            _ints(args.prefill_lens, "--prefill-lens"),
            () if args.mixed_batch.strip() == "0" else _ints(args.mixed_batch, "--mixed-batch"),
            args.steps,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cal, profiles = calibrate(config, grid, log=print)
    path = write(cal, args.out)
    print(f"{len(profiles)} profiles; fit (relative errors, median / p90 / max):")
    for stage, q in cal.quality.items():
        print(
            f"  {stage:<26} {q['median_rel_error']:6.1%} / {q['p90_rel_error']:6.1%} / "
            f"{q['max_rel_error']:6.1%}   r2 {q['r2']:.3f}"
        )
    for c in cal.check:
        print(
            f"  check {c['shape']}: measured {c['measured_ms']:.2f} ms/step overlapped, "
            f"model {c['predicted_ms']:.2f}"
        )
    coef = cal.costs.device.to_dict().get(MIXED_KV_TERM, 0.0)
    print(
        f"  mixed-step term: {1e9 * coef:.3g} ns per decode KV token of a step that also "
        f"prefills (profiled up to {cal.feature_max.get(MIXED_KV_TERM, 0):,.0f} such tokens)"
    )
    for m in mixed_report(cal.costs, profiles):
        print(
            f"  {m['shape']} ({m['steps']} steps with a chunk, {m['decode_kv_tokens']:,.0f} "
            f"decode KV tokens): device {m['measured_ms']:.2f} ms/step, model "
            f"{m['predicted_ms']:.2f} (the term {m['term_ms']:.2f})"
        )
    for servers, io in sorted(cal.core_io.items()):
        print(
            f"  engine-core send path, {servers} API server(s): {1e6 * io.step_s:.1f} us per "
            f"step + {1e6 * io.row_s:.3f} us per token"
        )
    t = cal.kv_transfer
    print(f"  KV transfer ({t.path}): {t.bytes_per_s / 1e9:.2f} GB/s + {1e3 * t.latency_s:.3f} ms")
    print(f"Wrote {path}")
    return 0


def _simulate(args: argparse.Namespace) -> int:
    return _run(_simulate_inner, args)


def _simulate_inner(args: argparse.Namespace) -> int:
    from nori_jax.bench import report
    from nori_jax.plan.planner import Planner

    _check_output(args.result_json, "--result-json")
    settings = _settings(args)
    planner = Planner(_calibrations(args)[0], settings)
    _header(planner)
    rate = settings.shaping.workload.request_rate
    outcome = planner.run_at(rate)
    bcfg = _bench_config(args, settings)
    print(report.load_header(bcfg, rate))
    report.print_run(bcfg, outcome.run, sys.stdout)
    print(_summary_line(outcome.summary))
    if args.result_json:
        _write_json(
            args.result_json,
            {
                "calibration": _calibration_dict(planner.cal),
                "engine": dataclasses.asdict(planner.engine),
                "planner_warnings": planner.warnings,
                **_run_dict(outcome),
            },
        )
    return 0


def _sweep(args: argparse.Namespace) -> int:
    return _run(_sweep_inner, args)


def _sweep_inner(args: argparse.Namespace) -> int:
    from nori_jax.bench import report
    from nori_jax.bench.sweep import SweepConfig, find_knee, run_sweep
    from nori_jax.plan.compare import (
        comparison,
        comparison_table,
        load_measured_sweep,
        simulated_step_ms,
    )
    from nori_jax.plan.planner import Planner

    measured = load_measured_sweep(args.measured) if args.measured else None
    if args.sweep and args.sweep != "auto":
        rates = _floats(args.sweep, "--sweep")
    elif measured is not None and not args.sweep:
        rates = tuple(r.request_rate for r in measured)
    else:
        rates = None
    if args.plot and not _has_matplotlib():
        raise ValueError("--plot needs matplotlib (the bench extra): pip install 'nori-jax[bench]'")
    plot = _plot_path(args.plot) if args.plot else None
    _check_output(plot, "--plot")
    _check_output(args.result_json, "--result-json")
    settings = _settings(args)
    planner = Planner(_calibrations(args)[0], settings)
    _header(planner)
    cfg = SweepConfig(
        rates=rates,
        start_rate=args.sweep_start_rate
        if args.sweep_start_rate is not None
        else _start_rate(planner, rates is None),
        max_steps=args.sweep_max_steps,
        min_gain=args.knee_min_gain,
        min_latency_rise=args.knee_min_latency_rise,
    )
    outcomes = {}

    def run_at(rate: float):
        outcome = planner.run_at(rate)
        if "steps" in outcome.summary:  # one engine (a disaggregated pair has no single step)
            step_ms = simulated_step_ms(outcome.run, outcome.summary["steps"])
            outcome.summary["mean_step_ms"] = step_ms
        outcomes[rate] = outcome
        return outcome.run

    runs, knee, reason = run_sweep(cfg, run_at)
    print(report.sweep_table(runs))
    if knee is None:
        print(f"Knee: not found within the simulated rates ({reason})")
    else:
        print(
            f"Knee: {knee.rate:g} req/s (throughput efficiency {knee.efficiency:.2f} and "
            f"P99 TTFT {knee.ttft_rise:+.0%} / TPOT {knee.tpot_rise:+.0%} at {knee.next_rate:g})"
        )
    compute_s = sum(o.summary["compute_s"] for o in outcomes.values())
    simulated_s = sum(o.run.metrics["duration"] for o in outcomes.values())
    print(f"Simulated {simulated_s:.0f} s of traffic in {compute_s:.1f} s")
    rows, measured_knee = [], None
    if measured is not None:
        measured_knee = find_knee(measured, cfg)
        step_ms = {r: o.summary.get("mean_step_ms") for r, o in outcomes.items()}
        rows = comparison(runs, measured, step_ms)
        if rows:
            print(comparison_table(rows))
        outside = [
            f"{r.request_rate:g}: {m['mean_ttft_ms'] - m['server_mean_ttft_ms']:.1f} ms"
            for r in measured
            if (m := r.metrics).get("server_mean_ttft_ms") is not None
            and m.get("mean_ttft_ms") is not None
        ]
        if outside:  # what --frontend-latency-ms stands for, as measured
            print("Measured path outside the engine (client mean TTFT - engine's), by rate: "
                  + ", ".join(outside))  # fmt: skip
        print(
            "Measured knee: "
            + (f"{measured_knee.rate:g} req/s" if measured_knee else "not found")
            + " (the bench's rule on the measured runs)"
        )
    if args.plot:
        title = f"{planner.cal.key.model} on {planner.cal.key.device} (simulated)"
        if measured is not None:
            from nori_jax.plan.plot import plot_against_measured

            plot_against_measured(runs, knee, measured, measured_knee, plot, title)
        else:
            from nori_jax.bench.plot import plot_sweep

            plot_sweep(runs, knee, plot, title)
        print(f"Plot: {plot}")
    if args.result_json:
        _write_json(
            args.result_json,
            {
                "calibration": _calibration_dict(planner.cal),
                "engine": dataclasses.asdict(planner.engine),
                "planner_warnings": planner.warnings,
                "knee_request_rate": knee.rate if knee else None,
                "knee": dataclasses.asdict(knee) if knee else None,
                "stop_reason": reason,
                "request_rates": [r.request_rate for r in runs],
                "runs": [_run_dict(outcomes[r.request_rate]) for r in runs],
                "measured": args.measured,
                "measured_knee_request_rate": measured_knee.rate if measured_knee else None,
                "comparison": rows,
            },
        )
    return 0


def _size(args: argparse.Namespace) -> int:
    return _run(_size_inner, args)


def _size_inner(args: argparse.Namespace) -> int:
    from nori_jax.bench.sweep import SweepConfig
    from nori_jax.plan.planner import Planner
    from nori_jax.plan.sizing import Slo, capacity, size

    _check_output(args.result_json, "--result-json")
    # Checked with the other flags: size() refuses it too, but only after the capacity search.
    _non_negative(args.target_rate, "--target-rate", positive=True)
    _non_negative(args.gpu_hour_price, "--gpu-hour-price")
    slo = Slo(_bounds(args.slo, "--slo"), args.slo_percentile)
    settings = _settings(args, extra_percentiles=(slo.percentile,))
    rows = []
    for cal in _calibrations(args, many=True):
        planner = Planner(cal, settings)
        _header(planner)
        sweep = SweepConfig(
            start_rate=args.search_start_rate
            if args.search_start_rate is not None
            else _start_rate(planner, True),
            max_steps=args.sweep_max_steps,
            min_gain=args.knee_min_gain,
            min_latency_rise=args.knee_min_latency_rise,
        )
        best = capacity(slo, lambda r, p=planner: p.run_at(r).run, sweep)
        sizing = size(
            args.target_rate, best.rate, planner.gpus, planner.tokens_per_request,
            args.gpu_hour_price,
        )  # fmt: skip
        at_share = planner.run_at(sizing.rate_per_replica).run.metrics
        rows.append((cal, planner, best, sizing, at_share))
        knee = f"knee {best.knee.rate:.3g} req/s" if best.knee else "no knee on the ramp"
        gpus = f"{planner.gpus} GPU{'s' if planner.gpus > 1 else ''}"
        if best.limited_by == "ramp":
            print(
                f"  one replica ({gpus}): capacity at least {best.rate:.3g} req/s (what its "
                f"last run served; no knee within the ramp's {best.runs} runs: a lower bound, "
                "so the replicas below are an upper bound; raise --sweep-max-steps)"
            )
        else:
            limit = "SLOs" if best.limited_by == "slo" else "knee"
            print(
                f"  one replica ({gpus}): capacity {best.rate:.3g} req/s, limited by the {limit} "
                f"(past it at {best.broken_at:.3g}; {knee}; {best.runs} runs)"
            )
    pw = slo.key
    print(" Sizing ".center(100, "="))
    print(
        f"{'layout':<32} {'req/s/replica':>13} {'replicas':>8} {'GPUs':>5} "
        + "".join(f" {name.upper() + ' P' + f'{slo.percentile:g}':>10}" for name in slo.limits_ms)
        + f" {'$/h':>8} {'$/M tok':>8} {'$/M out':>8}"
    )
    for cal, _, best, s, m in sorted(rows, key=lambda r: r[3].gpus):
        money = lambda x: "" if x is None else f"{x:.3f}"  # noqa: E731
        print(
            f"{cal.key.device + ' tp' + str(cal.key.tp) + ' ' + cal.key.kv_dtype:<32} "
            f"{best.rate:>13.3g} {s.replicas:>8} {s.gpus:>5} "
            + "".join(f" {m[pw(name)]:>10.1f}" for name in slo.limits_ms)
            + f" {money(s.cost_per_hour):>8} {money(s.cost_per_million_tokens):>8} "
            f"{money(s.cost_per_million_output_tokens):>8}"
        )
    cheapest = min(rows, key=lambda r: r[3].gpus)
    print(
        f"{args.target_rate:g} req/s within {' '.join(args.slo)} (P{slo.percentile:g}): "
        f"{cheapest[3].replicas} replicas, {cheapest[3].gpus} GPUs ({cheapest[0].key.device} "
        f"tp{cheapest[0].key.tp})"
    )
    if args.result_json:
        _write_json(
            args.result_json,
            {
                "target_rate": args.target_rate,
                "slo_ms": dict(slo.limits_ms),
                "slo_percentile": slo.percentile,
                "gpu_hour_price": args.gpu_hour_price,
                "layouts": [
                    {
                        "calibration": _calibration_dict(cal),
                        "max_rate_per_replica": best.rate,
                        "limited_by": best.limited_by,
                        "knee_request_rate": best.knee.rate if best.knee else None,
                        "broken_at": _finite(best.broken_at),
                        **dataclasses.asdict(s),
                        "metrics_at_share": {k: v for k, v in m.items() if k != "output_lens"},
                        "planner_warnings": planner.warnings,
                    }
                    for cal, planner, best, s, m in rows
                ],
            },
        )
    return 0
