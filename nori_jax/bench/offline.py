"""`nori-jax bench offline`: the engine in this process, no HTTP.

By default every request is queued at once (peak throughput). With `--request-rate R` requests
arrive as a Poisson process inside the process, which measures TTFT/TPOT/E2E without any HTTP or
client overhead. Workload shapers for scheduling experiments: `--shared-prefix-len` (every prompt
starts with the same system prompt) and `--long-prompts K --long-len L` (K very long prompts mixed
in; latency is then also reported for the short requests alone).

Reports total / output token throughput and request throughput after warm-up, and where the host's
wall time went: scheduling, launching steps (plan transfer + dispatch), waiting on the device, and
post-processing (updates, detokenization, metrics). With overlapped scheduling the device works
during the other three; "waiting" is the host idle on the device.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import numpy as np

from nori_jax.bench.arrivals import arrival_times
from nori_jax.bench.config import LognormalLengths
from nori_jax.bench.dataset import sample_lengths
from nori_jax.bench.runner import seeded_streams
from nori_jax.core.engine_core import StepTimes
from nori_jax.engine import LLMEngine
from nori_jax.engine_args import add_engine_args, engine_config_from_args
from nori_jax.sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]
    is_long: list[bool]


@dataclasses.dataclass(frozen=True)
class OfflineResult:
    num_requests: int
    elapsed_s: float
    input_tokens: int
    output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    steps: int
    mean_step_ms: float
    mean_tokens_per_step: float
    padding_fraction: float  # bucket tokens executed that were padding
    schedule_s: float
    launch_s: float  # plan transfer + dispatch
    wait_s: float  # host blocked on the device
    postprocess_s: float
    other_s: float  # wall time outside engine.step() (the driver loop itself, idle waits)
    num_preemptions: int
    prefix_cache_hit_rate: float
    num_recompiles: int
    compile_s: float
    load_s: float
    latency_ms: dict[str, dict[str, float]]  # metric -> {p50, p99, mean}, all / short requests


def draw_workload(args: argparse.Namespace, vocab_size: int, max_model_len: int) -> Workload:
    """Token-id prompts (exact lengths, no tokenizer needed) and output lengths, warm-up first.

    Lengths come from `bench serve`'s seeded streams in its order (input lengths, then output
    lengths), so one --bench-seed gives the lengths that `bench serve --seed` sends; only the
    random token ids differ.
    """
    data_rng, warm_rng, _ = seeded_streams(args.bench_seed)

    def lengths(n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        if args.dataset == "fixed":
            return np.full(n, args.input_len), np.full(n, args.output_len)
        ins = sample_lengths(
            LognormalLengths(args.input_mu, args.input_sigma, 1, args.input_max), n, rng
        )
        outs = sample_lengths(
            LognormalLengths(args.output_mu, args.output_sigma, 1, args.output_max), n, rng
        )
        return ins, outs

    (w_in, w_out), (m_in, m_out) = (
        lengths(args.warmup_requests, warm_rng),
        lengths(args.num_prompts, data_rng),
    )
    ins, outs = np.concatenate([w_in, m_in]), np.concatenate([w_out, m_out])
    is_long = np.zeros(len(ins), bool)
    if args.long_prompts:  # spread the long ones evenly through the measured requests
        idx = args.warmup_requests + np.linspace(0, args.num_prompts - 1, args.long_prompts).astype(
            int
        )
        ins[idx], is_long[idx] = args.long_len, True
    shared = data_rng.integers(10, vocab_size - 10, args.shared_prefix_len).tolist()
    ins = np.minimum(ins, max_model_len - 1 - len(shared))  # keep every request inside the context
    outs = np.minimum(outs, max_model_len - len(shared) - ins)
    prompts = [shared + data_rng.integers(10, vocab_size - 10, int(k)).tolist() for k in ins]
    return Workload(prompts, [int(o) for o in outs], is_long.tolist())


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    a = 1e3 * np.asarray(values)
    return {
        "mean": float(a.mean()),
        "p50": float(np.percentile(a, 50)),
        "p99": float(np.percentile(a, 99)),
    }


def run_workload(
    engine: LLMEngine, w: Workload, warmup: int, request_rate: float, seed: int
) -> OfflineResult:
    params = [SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True) for o in w.output_lens]

    def run(indices: list[int], rate: float):
        # bench serve's arrival times for this seed and rate (Poisson, last arrival at n / rate)
        *_, arr_rng = seeded_streams(seed)
        arrivals = arrival_times(len(indices), rate, 1.0, arr_rng)
        finished: dict[int, object] = {}
        ids: dict[str, int] = {}
        start = time.perf_counter()
        in_step, nxt = 0.0, 0
        while nxt < len(indices) or engine.has_unfinished_requests():
            now = time.perf_counter() - start
            while nxt < len(indices) and arrivals[nxt] <= now:
                i = indices[nxt]
                ids[engine.add_request(None, w.prompts[i], params[i], stream=False)] = i
                nxt += 1
            if not engine.has_unfinished_requests():
                time.sleep(max(0.0, arrivals[nxt] - (time.perf_counter() - start)))
                continue
            t = time.perf_counter()
            for out in engine.step():
                if out.finished:
                    finished[ids[out.request_id]] = out
            in_step += time.perf_counter() - t
        engine.drain()
        elapsed = time.perf_counter() - start
        return elapsed, elapsed - in_step, finished

    if warmup:
        run(list(range(warmup)), float("inf"))
    before = dataclasses.replace(engine.step_times)
    c0 = dataclasses.replace(engine.scheduler.counters)
    measured = list(range(warmup, len(w.prompts)))
    elapsed, other, finished = run(measured, request_rate)
    st, c1 = engine.step_times, engine.scheduler.counters
    d = StepTimes(*(getattr(st, f.name) - getattr(before, f.name) for f in dataclasses.fields(st)))
    latency = {}
    for label, keep in (("all", lambda i: True), ("short", lambda i: not w.is_long[i])):
        outs = [o for i, o in finished.items() if keep(i)]
        latency[f"ttft_{label}"] = _percentiles([o.metrics.time_to_first_token for o in outs])
        latency[f"tpot_{label}"] = _percentiles(
            [o.metrics.decode_time / (len(o.token_ids) - 1) for o in outs if len(o.token_ids) > 1]
        )
        latency[f"e2e_{label}"] = _percentiles([o.metrics.e2e_latency for o in outs])
    n_in = sum(len(w.prompts[i]) for i in measured)
    n_out = sum(w.output_lens[i] for i in measured)
    queries = c1.prefix_cache_queries - c0.prefix_cache_queries
    return OfflineResult(
        num_requests=len(measured),
        elapsed_s=elapsed,
        input_tokens=n_in,
        output_tokens=n_out,
        request_throughput=len(measured) / elapsed,
        output_throughput=n_out / elapsed,
        total_token_throughput=(n_in + n_out) / elapsed,
        steps=d.steps,
        mean_step_ms=1e3 * (d.schedule + d.launch + d.wait + d.postprocess) / max(d.steps, 1),
        mean_tokens_per_step=d.tokens / max(d.steps, 1),
        padding_fraction=1 - d.tokens / max(d.padded_tokens, 1),
        schedule_s=d.schedule,
        launch_s=d.launch,
        wait_s=d.wait,
        postprocess_s=d.postprocess,
        other_s=other,
        num_preemptions=c1.num_preemptions - c0.num_preemptions,
        prefix_cache_hit_rate=(c1.prefix_cache_hits - c0.prefix_cache_hits) / max(queries, 1),
        num_recompiles=engine.num_recompiles,
        compile_s=engine.runner.compile_seconds,
        load_s=engine.load_seconds,
        latency_ms=latency,
    )


def format_result(r: OfflineResult) -> str:
    pct = lambda x: f"{100 * x / r.elapsed_s:5.1f}%"
    row = lambda k, v: f"{k:<40}{v:>20}"
    lines = [
        "{s:=^60}".format(s=" Offline Benchmark Result "),
        row("Requests:", r.num_requests),
        row("Elapsed (s):", f"{r.elapsed_s:.2f}"),
        row("Input / output tokens:", f"{r.input_tokens} / {r.output_tokens}"),
        row("Request throughput (req/s):", f"{r.request_throughput:.2f}"),
        row("Output token throughput (tok/s):", f"{r.output_throughput:.1f}"),
        row("Total token throughput (tok/s):", f"{r.total_token_throughput:.1f}"),
        row("Steps / mean step (ms):", f"{r.steps} / {r.mean_step_ms:.2f}"),
        row(
            "Tokens per step / padding:",
            f"{r.mean_tokens_per_step:.0f} / {100 * r.padding_fraction:.0f}%",
        ),
        row("Time: schedule", pct(r.schedule_s)),
        row("Time: launch (transfer + dispatch)", pct(r.launch_s)),
        row("Time: waiting on the device", pct(r.wait_s)),
        row("Time: postprocess", pct(r.postprocess_s)),
        row("Time: driver loop / idle", pct(r.other_s)),
        row(
            "Preemptions / prefix hit rate:",
            f"{r.num_preemptions} / {100 * r.prefix_cache_hit_rate:.0f}%",
        ),
        row("Recompiles after warm-up:", r.num_recompiles),
        row("Load / compile (s):", f"{r.load_s:.1f} / {r.compile_s:.1f}"),
    ]
    for name, stats in r.latency_ms.items():
        if stats:
            lines.append(row(f"{name} p50 / p99 (ms):", f"{stats['p50']:.1f} / {stats['p99']:.1f}"))
    lines.append("=" * 60)
    return "\n".join(lines)


def check_args(args: argparse.Namespace) -> None:
    """ValueError naming the first bad workload flag (before any model is loaded)."""
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {args.request_rate}")
    if args.num_prompts < 1 or args.warmup_requests < 0:
        raise ValueError(
            f"need --num-prompts >= 1 and --warmup-requests >= 0, got {args.num_prompts} and "
            f"{args.warmup_requests}"
        )
    if not 0 <= args.long_prompts <= args.num_prompts or args.shared_prefix_len < 0:
        raise ValueError(
            f"need 0 <= --long-prompts <= --num-prompts and --shared-prefix-len >= 0, got "
            f"{args.long_prompts} and {args.shared_prefix_len}"
        )


def _run(args: argparse.Namespace) -> int:
    try:
        check_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    engine = LLMEngine(engine_config_from_args(args))
    w = draw_workload(args, engine.model.config.vocab_size, engine.max_model_len)
    result = run_workload(engine, w, args.warmup_requests, args.request_rate, args.bench_seed)
    print(format_result(result))
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(
                {**dataclasses.asdict(result), "config": dataclasses.asdict(engine.config)},
                f,
                indent=2,
                default=str,
            )
    return 0


def add_bench_offline_parser(sub) -> None:
    p = sub.add_parser("offline", help="throughput (and in-process latency) of the engine, no HTTP")
    add_engine_args(p)
    p.add_argument("--dataset", choices=["lognormal", "fixed"], default="lognormal")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--warmup-requests", type=int, default=16)
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="Poisson arrivals in process (req/s); inf queues everything at once",
    )
    p.add_argument("--input-mu", type=float, default=6.2)
    p.add_argument("--input-sigma", type=float, default=0.8)
    p.add_argument("--input-max", type=int, default=6144)
    p.add_argument("--output-mu", type=float, default=5.5)
    p.add_argument("--output-sigma", type=float, default=0.7)
    p.add_argument("--output-max", type=int, default=2048)
    p.add_argument("--input-len", type=int, default=1024, help="fixed dataset")
    p.add_argument("--output-len", type=int, default=128, help="fixed dataset")
    p.add_argument(
        "--shared-prefix-len",
        type=int,
        default=0,
        help="tokens of a system prompt every request starts with",
    )
    p.add_argument("--long-prompts", type=int, default=0, help="very long prompts mixed in")
    p.add_argument("--long-len", type=int, default=6000, help="length of those long prompts")
    # Its own dest: the engine's --seed (sampling, dummy weights) defaults to None, and sharing
    # one dest would make every run draw a different workload.
    p.add_argument(
        "--bench-seed", type=int, default=0, help="seed of the drawn workload and arrivals"
    )
    p.add_argument("--result-json", default=None)
    p.set_defaults(func=_run)
