"""`nori-jax bench offline`: the engine in this process, no HTTP; every request queued at once.

Reports total / output token throughput and request throughput for the run after warm-up, and where
the wall time went: scheduling, the device step (incl. transfers and the token fetch), the rest of
the host loop (updates, detokenization, metrics).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import numpy as np

from nori_jax.bench.config import LognormalLengths
from nori_jax.bench.dataset import sample_lengths
from nori_jax.engine import LLMEngine, StepTimes
from nori_jax.engine_args import add_engine_args, engine_config_from_args
from nori_jax.sampling_params import SamplingParams


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
    device_s: float
    postprocess_s: float
    other_s: float  # wall time outside engine.step() (the driver loop itself)
    num_preemptions: int
    num_recompiles: int
    compile_s: float
    load_s: float


def draw_workload(args: argparse.Namespace, vocab_size: int, max_model_len: int):
    """(prompts as token ids, output lengths): token-id prompts need no tokenizer and are exact."""
    rng = np.random.default_rng(args.seed)
    n = args.num_prompts + args.warmup_requests
    if args.dataset == "fixed":
        ins, outs = np.full(n, args.input_len), np.full(n, args.output_len)
    else:
        ins = sample_lengths(LognormalLengths(args.input_mu, args.input_sigma, 1, args.input_max), n, rng)
        outs = sample_lengths(LognormalLengths(args.output_mu, args.output_sigma, 1, args.output_max), n, rng)
    # Keep each request inside the context: clip the prompt first, then the output.
    ins = np.minimum(ins, max_model_len - 1)
    outs = np.minimum(outs, max_model_len - ins)
    prompts = [rng.integers(10, vocab_size - 10, int(k)).tolist() for k in ins]
    return prompts, [int(o) for o in outs]


def run_offline(engine: LLMEngine, prompts: list[list[int]], output_lens: list[int], warmup: int) -> OfflineResult:
    def run(batch_prompts, batch_outs) -> tuple[float, float]:
        for p, o in zip(batch_prompts, batch_outs, strict=True):
            engine.add_request(None, p, SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True))
        start = time.perf_counter()
        in_step = 0.0
        while engine.has_unfinished_requests():
            t = time.perf_counter()
            engine.step()
            in_step += time.perf_counter() - t
        elapsed = time.perf_counter() - start
        return elapsed, elapsed - in_step

    if warmup:
        run(prompts[:warmup], output_lens[:warmup])
    before = dataclasses.replace(engine.step_times)
    preempt_before = engine.scheduler.counters.num_preemptions
    elapsed, other = run(prompts[warmup:], output_lens[warmup:])
    st = engine.step_times
    d = StepTimes(*(getattr(st, f.name) - getattr(before, f.name) for f in dataclasses.fields(st)))
    n_in = sum(len(p) for p in prompts[warmup:])
    n_out = sum(output_lens[warmup:])
    return OfflineResult(
        num_requests=len(prompts) - warmup, elapsed_s=elapsed, input_tokens=n_in, output_tokens=n_out,
        request_throughput=(len(prompts) - warmup) / elapsed, output_throughput=n_out / elapsed,
        total_token_throughput=(n_in + n_out) / elapsed, steps=d.steps,
        mean_step_ms=1e3 * (d.schedule + d.device + d.postprocess) / max(d.steps, 1),
        mean_tokens_per_step=d.tokens / max(d.steps, 1),
        padding_fraction=1 - d.tokens / max(d.padded_tokens, 1),
        schedule_s=d.schedule, device_s=d.device, postprocess_s=d.postprocess, other_s=other,
        num_preemptions=engine.scheduler.counters.num_preemptions - preempt_before,
        num_recompiles=engine.num_recompiles, compile_s=engine.runner.compile_seconds,
        load_s=engine.load_seconds,
    )


def format_result(r: OfflineResult) -> str:
    pct = lambda x: f"{100 * x / r.elapsed_s:5.1f}%"
    return "\n".join([
        "{s:=^60}".format(s=" Offline Benchmark Result "),
        f"{'Requests:':<40}{r.num_requests:>20}",
        f"{'Elapsed (s):':<40}{r.elapsed_s:>20.2f}",
        f"{'Input / output tokens:':<40}{f'{r.input_tokens} / {r.output_tokens}':>20}",
        f"{'Request throughput (req/s):':<40}{r.request_throughput:>20.2f}",
        f"{'Output token throughput (tok/s):':<40}{r.output_throughput:>20.1f}",
        f"{'Total token throughput (tok/s):':<40}{r.total_token_throughput:>20.1f}",
        f"{'Steps / mean step (ms):':<40}{f'{r.steps} / {r.mean_step_ms:.2f}':>20}",
        f"{'Tokens per step / padding:':<40}{f'{r.mean_tokens_per_step:.0f} / {100 * r.padding_fraction:.0f}%':>20}",
        f"{'Time: schedule':<40}{pct(r.schedule_s):>20}",
        f"{'Time: device step (+transfers)':<40}{pct(r.device_s):>20}",
        f"{'Time: postprocess':<40}{pct(r.postprocess_s):>20}",
        f"{'Time: driver loop':<40}{pct(r.other_s):>20}",
        f"{'Preemptions / recompiles:':<40}{f'{r.num_preemptions} / {r.num_recompiles}':>20}",
        f"{'Load / compile (s):':<40}{f'{r.load_s:.1f} / {r.compile_s:.1f}':>20}",
        "=" * 60,
    ])


def _run(args: argparse.Namespace) -> int:
    engine = LLMEngine(engine_config_from_args(args))
    prompts, outs = draw_workload(args, engine.model.config.vocab_size, engine.max_model_len)
    result = run_offline(engine, prompts, outs, args.warmup_requests)
    print(format_result(result))
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump({**dataclasses.asdict(result), "config": dataclasses.asdict(engine.config)}, f,
                      indent=2, default=str)
    return 0


def add_bench_offline_parser(sub) -> None:
    p = sub.add_parser("offline", help="throughput of the engine in process (no HTTP)")
    add_engine_args(p)
    p.add_argument("--dataset", choices=["lognormal", "fixed"], default="lognormal")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--warmup-requests", type=int, default=16)
    p.add_argument("--input-mu", type=float, default=6.2)
    p.add_argument("--input-sigma", type=float, default=0.8)
    p.add_argument("--input-max", type=int, default=6144)
    p.add_argument("--output-mu", type=float, default=5.5)
    p.add_argument("--output-sigma", type=float, default=0.7)
    p.add_argument("--output-max", type=int, default=2048)
    p.add_argument("--input-len", type=int, default=1024, help="fixed dataset")
    p.add_argument("--output-len", type=int, default=128, help="fixed dataset")
    p.add_argument("--result-json", default=None)
    p.set_defaults(func=_run, seed=0)
