"""Host work per engine step at N running requests, with a fake device (no JAX, CPU only).

    python benchmarks/engine/host_step_bench.py [--requests 1024] [--context 1024] [--steps 100]
        [--num-scheduler-steps K] [--penalized SHARE] [--min-tokens N]
        [--top-logprobs K [--top-share SHARE]]

Fills N requests of `--context` random prompt tokens, runs until all of them decode, then times
the engine core's host stages per decode step: schedule (the scheduler), plan (the plan builder's
packed buffers), update (the scheduler applying the samples) and outputs (the output processor,
final-only outputs as `LLM.generate` asks, or streamed deltas with `--stream`). The fake device
returns random tokens at once, so this is the host's share alone; on a GPU it overlaps the device.
With `--num-scheduler-steps K` every decode step is a multi-step launch of K steps: the times are
per launch, and per decode step (a launch's over K) beside them. `--penalized` gives that share
of the requests presence, frequency and repetition penalties (listed rows in every step);
`--min-tokens N` gives every request min_tokens N (banned-id entries while below it: the first
N - 1 decode steps are timed unless --steps is larger); `--top-logprobs K` gives that share of
them (`--top-share`, all by default) logprobs=K, the fake device returning each listed row's
TOP_LOGPROBS pairs as the runner does (K = 0: each sampled token's logprob alone).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np

from nori_jax.core.engine_core import EngineCore, EngineCoreRequest
from nori_jax.core.output_processor import OutputProcessor
from nori_jax.core.paging import PageAllocator
from nori_jax.core.plan_builder import PlanBuilder
from nori_jax.core.scheduler import Scheduler
from nori_jax.core.scheduler_config import SchedulerConfig
from nori_jax.core.step_layout import TOP_LOGPROBS
from nori_jax.heap_freeze import heap_frozen
from nori_jax.sampling_params import SamplingParams

VOCAB = 49152


class FakeExecutor:
    num_recompiles = 0

    def __init__(self, rows: int, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.rows = rows

    def launch(self, plan):
        shape = (self.rows,) if plan.num_steps == 1 else (plan.num_steps, self.rows)
        tokens = self.rng.integers(10, VOCAB, shape).astype(np.int32)
        n = len(plan.scheduled.top_rows)  # the runner's top-logprobs output, for its listed rows
        top = None
        if n:
            ids = self.rng.integers(10, VOCAB, (n, TOP_LOGPROBS)).astype(np.int32)
            top = (ids, -np.sort(self.rng.random((n, TOP_LOGPROBS), np.float32), axis=1))
        return tokens, top

    def fetch(self, handle):
        tokens, top = handle
        return tokens, np.zeros(tokens.shape, np.float32), top, None


def fake_core(cfg: SchedulerConfig, num_pages: int) -> EngineCore:
    """The engine core (real scheduler, page pool of `num_pages`, plan builder) over the fake
    device: what this script and host_mixed_bench.py / shape_mix.py drive."""
    scheduler = Scheduler(cfg, PageAllocator(num_pages, cfg.page_size, cfg.enable_prefix_caching))
    builder = PlanBuilder(
        cfg.max_num_seqs, cfg.max_pages_per_seq, cfg.page_size, num_pages, scheduler.buckets, VOCAB
    )
    return EngineCore(scheduler, builder, FakeExecutor(cfg.max_num_seqs))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=1024)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--stream", action="store_true", help="streamed outputs (no tokenizer)")
    p.add_argument("--num-scheduler-steps", type=int, default=1, help="multi-step decode's K")
    p.add_argument("--penalized", type=float, default=0.0, help="share of requests with penalties")
    p.add_argument("--min-tokens", type=int, default=0, help="every request's min_tokens")
    p.add_argument(
        "--top-logprobs",
        type=int,
        default=None,
        help="logprobs=K for a share of them (0: each sampled token's logprob alone)",
    )
    p.add_argument("--top-share", type=float, default=1.0, help="share with --top-logprobs")
    args = p.parse_args()
    n, ps, k = args.requests, 64, args.num_scheduler_steps
    cfg = SchedulerConfig(
        max_model_len=8192,
        page_size=ps,
        max_num_seqs=n,
        max_num_batched_tokens=max(8192, n),
        num_scheduler_steps=k,
        multi_step_max_seqs=n,
    )
    num_pages = n * (args.context // ps + 8 + k * args.steps // ps) + 16
    core = fake_core(cfg, num_pages)
    scheduler, builder = core.scheduler, core.builder
    processor = OutputProcessor(None)
    rng = np.random.default_rng(1)
    plain = SamplingParams(max_tokens=1 << 20, temperature=0.0, min_tokens=args.min_tokens)
    penalized = SamplingParams(
        max_tokens=1 << 20,
        temperature=0.0,
        min_tokens=args.min_tokens,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        repetition_penalty=1.1,
    )
    for i in range(n):
        prompt = rng.integers(10, VOCAB, args.context).tolist()
        params = penalized if i < args.penalized * n else plain
        if args.top_logprobs is not None and i >= n - args.top_share * n:  # the last share of them
            params = dataclasses.replace(params, logprobs=args.top_logprobs)
        core.add_request(EngineCoreRequest(f"r{i}", prompt, params, 0, [2], time.monotonic()))
        processor.add(f"r{i}", None, prompt, params, (2,), stream=args.stream)
    while True:  # prefill everything
        out = core.step()
        processor.process(out)
        sched = scheduler.schedule
        if len(scheduler.running) == n and all(
            scheduler.slots.computed[r.slot] >= args.context for r in scheduler.running
        ):
            break
    for _ in range(3):
        processor.process(core.step())

    # Time the stages of a decode step directly (the same calls EngineCore.step makes).
    totals = dict(schedule=0.0, plan=0.0, update=0.0, outputs=0.0)
    ex = core.executor
    with heap_frozen(collect=True):  # as the engine runs its loop (nori_jax/heap_freeze.py)
        for _ in range(args.steps):
            t0 = time.perf_counter()
            scheduled = sched()
            t1 = time.perf_counter()
            plan = builder.build(scheduled)
            t2 = time.perf_counter()
            tokens, logprobs, top, _ = ex.fetch(ex.launch(plan))
            t3 = time.perf_counter()
            upd = scheduler.update(scheduled, tokens, logprobs, top)
            t4 = time.perf_counter()
            processor.process(core._outputs(upd))
            t5 = time.perf_counter()
            totals["schedule"] += t1 - t0
            totals["plan"] += t2 - t1
            totals["update"] += t4 - t3
            totals["outputs"] += t5 - t4
    per = {k: 1e3 * v / args.steps for k, v in totals.items()}
    rows, kind = scheduled.num_decodes, "streamed" if args.stream else "final-only"
    launch = f"launch of {k} steps" if k > 1 else "step"
    print(
        f"{n} running requests ({rows} decode rows per step), {kind} outputs: "
        + ", ".join(f"{name} {v:.3f} ms" for name, v in per.items())
        + f"; total {sum(per.values()):.3f} ms per {launch}"
        + (f", {sum(per.values()) / k:.3f} ms per decode step" if k > 1 else "")
    )


if __name__ == "__main__":
    main()
