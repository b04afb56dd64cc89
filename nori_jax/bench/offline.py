"""`nori-jax bench offline`: the engine in this process, no HTTP, through its public API only
(`LLMEngine`: add_request, step, drain, get_metrics, step_times, step_shapes).

By default every request is queued at once (peak throughput). With `--request-rate R` requests
arrive on `bench serve`'s schedule for the same seed, which measures TTFT/TPOT/E2E without any
HTTP or client overhead. Workload shapers for scheduling experiments: `--shared-prefix-len` (every
prompt starts with the same system prompt) and `--long-prompts K --long-len L` (K very long
prompts mixed in; latency is then also reported for the short requests alone).

Reports throughput after warm-up, and where the host's wall time went: scheduling, launching
steps (plan transfer + dispatch), waiting on the device, and post-processing (updates,
detokenization, metrics). With overlapped scheduling the device works during the other three;
"waiting" is the host idle on the device. Then the same run by step shape (core/step_shapes.py):
per token bucket and kind (decode, mixed, prefill), the launches and their wall time each, so two
runs (bf16 against fp8 weights, say) can be told apart regime by regime.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from nori_jax.bench.workload import (
    HelpFormatter,
    WorkloadConfig,
    add_workload_args,
    workload_from_args,
)
from nori_jax.core.step_shapes import format_rows
from nori_jax.engine_args import add_engine_args, engine_config_from_args
from nori_jax.heap_freeze import heap_frozen

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from nori_jax import LLMEngine, SamplingParams


_SAMPLING_STREAM = 3  # workload.py's request, warm-up and arrival streams are 0-2


@dataclasses.dataclass(frozen=True)
class OfflineConfig:
    workload: WorkloadConfig
    shared_prefix_len: int = 0
    long_prompts: int = 0
    long_len: int = 6000
    # SamplingParams fields for a share of the measured requests (what penalties, min_tokens or
    # prompt logprobs cost the engine); the rest stay greedy.
    sampling: dict[str, Any] = dataclasses.field(default_factory=dict)
    sampling_share: float = 1.0

    def __post_init__(self) -> None:
        if self.workload.dataset == "jsonl":
            raise ValueError("bench offline draws token ids: use --dataset lognormal or fixed")
        if not 0 <= self.long_prompts <= self.workload.num_prompts:
            raise ValueError(f"need 0 <= --long-prompts <= --num-prompts, got {self.long_prompts}")
        if self.shared_prefix_len < 0 or self.long_len < 1:
            raise ValueError(
                f"need --shared-prefix-len >= 0 and --long-len >= 1, got "
                f"{self.shared_prefix_len} and {self.long_len}"
            )
        if not 0.0 <= self.sampling_share <= 1.0:
            raise ValueError(f"need 0 <= --sampling-share <= 1, got {self.sampling_share}")
        if self.sampling:  # a field or value SamplingParams refuses fails here, named
            try:
                request_params(self, 16)
            except (TypeError, ValueError) as e:
                raise ValueError(f"--sampling: {e}") from None


def request_params(cfg: OfflineConfig, max_tokens: int, sampled: bool = True) -> SamplingParams:
    """Greedy with ignore_eos, plus `cfg.sampling` for a request of the share; its min_tokens is
    capped at the request's drawn output length (min_tokens may not pass max_tokens)."""
    from nori_jax import SamplingParams

    extra = dict(cfg.sampling) if sampled else {}
    if "min_tokens" in extra:
        extra["min_tokens"] = min(int(extra["min_tokens"]), max_tokens)
    return SamplingParams(
        **{"temperature": 0.0, "ignore_eos": True, **extra}, max_tokens=max_tokens
    )


@dataclasses.dataclass(frozen=True)
class Requests:
    prompts: list[list[int]]  # warm-up first
    output_lens: list[int]
    is_long: list[bool]
    sampled: list[bool]  # carries OfflineConfig.sampling (never a warm-up request)
    clamped: int = 0  # measured requests whose drawn lengths were cut to fit max_model_len


def draw_requests(cfg: OfflineConfig, vocab_size: int, max_model_len: int) -> Requests:
    """Token-id prompts of exactly the drawn lengths, from `bench serve`'s streams in its order:
    one seed gives the lengths `bench serve --seed` sends; only the token ids differ."""
    w = cfg.workload
    room = max_model_len - 2  # after the shared prefix: a prompt token and an output token
    if cfg.shared_prefix_len > room:
        raise ValueError(
            f"--shared-prefix-len {cfg.shared_prefix_len} leaves no room in the engine's "
            f"max_model_len={max_model_len}: it must be at most {room}"
        )
    data_rng, warm_rng = w.streams()
    w_in, w_out = w.lengths(w.warmup_requests, warm_rng)
    m_in, m_out = w.lengths(w.num_prompts, data_rng)
    ins, outs = np.array(w_in + m_in, dtype=np.int64), np.array(w_out + m_out, dtype=np.int64)
    is_long = np.zeros(len(ins), bool)
    if cfg.long_prompts:  # spread the long ones evenly through the measured requests
        idx = np.linspace(0, w.num_prompts - 1, cfg.long_prompts).astype(int) + w.warmup_requests
        ins[idx], is_long[idx] = cfg.long_len, True
    shared = data_rng.integers(10, vocab_size - 10, cfg.shared_prefix_len).tolist()
    drawn = ins + outs
    ins = np.minimum(ins, max_model_len - 1 - len(shared))  # every request inside the context
    outs = np.minimum(outs, max_model_len - len(shared) - ins)
    # (`bench serve` sends the drawn lengths as they are: a cut request is another workload)
    clamped = int(np.count_nonzero((ins + outs + len(shared) < drawn)[w.warmup_requests :]))
    if clamped:
        logger.warning(
            "%d of %d requests were cut to fit max_model_len=%d (input + output): this run's "
            "workload is not the one `bench serve --seed %d` sends",
            clamped,
            w.num_prompts,
            max_model_len,
            w.seed,
        )
    prompts = [shared + data_rng.integers(10, vocab_size - 10, int(k)).tolist() for k in ins]
    # Its own stream, so that the share changes no length or prompt of the draw.
    share = np.random.default_rng([w.seed, _SAMPLING_STREAM]).random(len(ins)) < cfg.sampling_share
    share[: w.warmup_requests] = False
    sampled = (share & bool(cfg.sampling)).tolist()
    return Requests(prompts, outs.tolist(), is_long.tolist(), sampled, clamped)


def run_offline(engine: LLMEngine, cfg: OfflineConfig, reqs: Requests) -> dict[str, Any]:
    """Warm up, then run the measured requests on their schedule; the result, as JSON keys."""
    w = cfg.workload
    params = [
        request_params(cfg, o, s) for o, s in zip(reqs.output_lens, reqs.sampled, strict=True)
    ]

    def run(indices: list[int], rate: float) -> tuple[float, float, dict[int, Any]]:
        arrivals = w.arrival_times(len(indices), rate)
        finished: dict[int, Any] = {}
        ids: dict[str, int] = {}
        start, start_monotonic = time.perf_counter(), time.monotonic()
        in_step, nxt = 0.0, 0
        while nxt < len(indices) or engine.has_unfinished_requests():
            now = time.perf_counter() - start
            while nxt < len(indices) and arrivals[nxt] <= now:
                i = indices[nxt]
                # Its arrival is its scheduled time, not when this loop got to it (between two
                # steps, up to a step or a multi-step launch later): TTFT counts that wait.
                arrival = start_monotonic + arrivals[nxt]
                ids[engine.add_request(None, reqs.prompts[i], params[i], arrival, stream=False)] = i
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

    if w.warmup_requests:
        run(list(range(w.warmup_requests)), float("inf"))
    times0, metrics0 = dataclasses.asdict(engine.step_times), engine.get_metrics()
    shapes0 = engine.step_shapes.copy()
    measured = list(range(w.warmup_requests, len(reqs.prompts)))
    with heap_frozen():  # as LLM.generate runs its loop (nori_jax/heap_freeze.py)
        elapsed, other, finished = run(measured, w.request_rate)
    d = {k: v - times0[k] for k, v in dataclasses.asdict(engine.step_times).items()}
    delta = lambda name: engine.get_metrics()[f"nori:{name}_total"] - metrics0[f"nori:{name}_total"]  # noqa: E731
    latency = {}
    for label, keep in (("all", lambda i: True), ("short", lambda i: not reqs.is_long[i])):
        outs = [o for i, o in finished.items() if keep(i)]
        latency[f"ttft_{label}"] = _stats([o.metrics.time_to_first_token for o in outs])
        latency[f"tpot_{label}"] = _stats(
            [o.metrics.decode_time / (len(o.token_ids) - 1) for o in outs if len(o.token_ids) > 1]
        )
        latency[f"e2e_{label}"] = _stats([o.metrics.e2e_latency for o in outs])
    n_in = sum(len(reqs.prompts[i]) for i in measured)
    n_out = sum(len(o.token_ids) for o in finished.values())  # generated, not planned
    steps = max(d["steps"], 1)
    return {
        "num_requests": len(measured),
        "num_sampled_requests": sum(reqs.sampled),  # those carrying --sampling
        "num_clamped_requests": reqs.clamped,  # cut to fit max_model_len (a warning says so)
        "elapsed_s": elapsed,
        "input_tokens": n_in,
        "output_tokens": n_out,
        "request_throughput": len(measured) / elapsed,
        "output_throughput": n_out / elapsed,
        "total_token_throughput": (n_in + n_out) / elapsed,
        "steps": d["steps"],
        "multi_step_launches": d["multi_step_launches"],  # of `steps` (num_scheduler_steps)
        "mean_step_ms": 1e3 * (d["schedule"] + d["launch"] + d["wait"] + d["postprocess"]) / steps,
        "mean_tokens_per_step": d["tokens"] / steps,
        "padding_fraction": 1 - d["tokens"] / max(d["padded_tokens"], 1),
        "schedule_s": d["schedule"],
        "launch_s": d["launch"],  # plan transfer + dispatch
        "wait_s": d["wait"],  # host blocked on the device
        "postprocess_s": d["postprocess"],
        "other_s": other,  # outside engine.step(): the driver loop itself, idle waits
        "num_preemptions": int(delta("num_preemptions")),
        "prefix_cache_hit_rate": delta("prefix_cache_hits") / max(delta("prefix_cache_queries"), 1),
        "num_recompiles": int(engine.get_metrics()["nori:recompiles_total"]),
        "latency_ms": latency,
        "step_shapes": engine.step_shapes.minus(shapes0).rows(),
    }


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    a = 1e3 * np.asarray(values)
    return {"mean": float(a.mean()), "p50": float(np.median(a)), "p99": float(np.percentile(a, 99))}


def format_result(r: dict[str, Any]) -> str:
    pct = lambda x: f"{100 * x / r['elapsed_s']:5.1f}%"  # noqa: E731
    rows = [
        ("Requests (with --sampling):", f"{r['num_requests']} ({r['num_sampled_requests']})"),
        ("Elapsed (s):", f"{r['elapsed_s']:.2f}"),
        ("Input / output tokens:", f"{r['input_tokens']} / {r['output_tokens']}"),
        ("Request throughput (req/s):", f"{r['request_throughput']:.2f}"),
        ("Output token throughput (tok/s):", f"{r['output_throughput']:.1f}"),
        ("Total token throughput (tok/s):", f"{r['total_token_throughput']:.1f}"),
        ("Steps / mean step (ms):", f"{r['steps']} / {r['mean_step_ms']:.2f}"),
        ("Of them, multi-step launches:", r.get("multi_step_launches", 0)),
        (
            "Tokens per step / padding:",
            f"{r['mean_tokens_per_step']:.0f} / {100 * r['padding_fraction']:.0f}%",
        ),
        ("Time: schedule", pct(r["schedule_s"])),
        ("Time: launch (transfer + dispatch)", pct(r["launch_s"])),
        ("Time: waiting on the device", pct(r["wait_s"])),
        ("Time: postprocess", pct(r["postprocess_s"])),
        ("Time: driver loop / idle", pct(r["other_s"])),
        (
            "Preemptions / prefix hit rate:",
            f"{r['num_preemptions']} / {100 * r['prefix_cache_hit_rate']:.0f}%",
        ),
        ("Recompiles after warm-up:", r["num_recompiles"]),
        ("Start-up: load + compile (s):", f"{r['startup_s']:.1f}"),
    ]
    rows += [
        (f"{name} p50 / p99 (ms):", f"{s['p50']:.1f} / {s['p99']:.1f}")
        for name, s in r["latency_ms"].items()
        if s
    ]
    lines = [" Offline Benchmark Result ".center(60, "=")]
    lines += [f"{k:<40}{v:>20}" for k, v in rows] + ["=" * 60]
    if r.get("step_shapes"):
        lines.append(format_rows(r["step_shapes"]))
    return "\n".join(lines)


def config_from_args(args: argparse.Namespace) -> OfflineConfig:
    try:
        sampling = json.loads(args.sampling) if args.sampling else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"--sampling is not JSON: {e}") from None
    if not isinstance(sampling, dict):
        raise ValueError(
            f"--sampling must be a JSON object of SamplingParams fields, got {args.sampling}"
        )
    return OfflineConfig(
        workload_from_args(args),
        args.shared_prefix_len,
        args.long_prompts,
        args.long_len,
        sampling,
        args.sampling_share,
    )


def _run(args: argparse.Namespace) -> int:
    from nori_jax.engine import make_engine

    try:
        cfg = config_from_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    engine = make_engine(engine_config_from_args(args))
    startup_s = time.perf_counter() - start
    vocab = engine.tokenizer.vocab_size if engine.tokenizer is not None else 1000
    try:  # (max_model_len is known only now: the engine resolves it from the model)
        reqs = draw_requests(cfg, vocab, engine.max_model_len)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result = run_offline(engine, cfg, reqs)
    result["startup_s"] = startup_s
    print(format_result(result))
    if args.result_json:
        with open(args.result_json, "w") as f:
            config = dataclasses.asdict(engine.config)
            json.dump(result | {"config": config}, f, indent=2, default=str)
    return 0


def add_bench_offline_parser(sub: Any) -> None:
    p = sub.add_parser(
        "offline",
        help="throughput (and in-process latency) of the engine, no HTTP",
        description="The engine in this process on bench serve's workload; see docs/bench.md.",
        formatter_class=HelpFormatter,
    )
    add_engine_args(p)
    # Its own seed flag: the engine's --seed (sampling, dummy weights) defaults to None, and
    # sharing it would make every run draw a different workload.
    add_workload_args(p, ("lognormal", "fixed"), "--bench-seed", warmup=16)
    g = p.add_argument_group("offline")
    g.add_argument(
        "--shared-prefix-len", type=int, default=0, help="tokens of a prompt start shared by all"
    )
    g.add_argument("--long-prompts", type=int, default=0, help="very long prompts mixed in")
    g.add_argument("--long-len", type=int, default=6000, help="length of those long prompts")
    g.add_argument(
        "--sampling",
        metavar="JSON",
        help="SamplingParams fields for a share of the requests, e.g. "
        '\'{"repetition_penalty": 1.1, "min_tokens": 16}\' (default: all greedy)',
    )
    g.add_argument(
        "--sampling-share",
        type=float,
        default=1.0,
        help="share of the measured requests that carry --sampling (seeded draw)",
    )
    g.add_argument("--result-json", help="write the result and engine config here (default: none)")
    p.set_defaults(func=_run)
