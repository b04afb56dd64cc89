"""The step shapes an offline workload gives, from the real scheduler over a fake device (CPU).

    python benchmarks/engine/shape_mix.py [--num-prompts 600] [--num-pages 10164]
        [--max-num-seqs 1024] [--max-num-batched-tokens 8192] [--page-size 64]

Draws `bench offline`'s workload (PERF.md's lognormal lengths, the bench's default seed: the same
requests as `nori-jax bench offline --num-prompts N`, warm-up left out), queues every request at
once and runs the engine core (Scheduler, PageAllocator, PlanBuilder) over a fake executor that
samples random tokens, until all have finished. Prints the launches by step shape (token bucket,
kind) with their mean real tokens: how many steps of each regime a GPU run will take, with
`--num-pages` the pool that run has (its start-up log says it). Counts only: the fake device
takes no time, so what each shape costs is `bench offline`'s table on the GPU.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from host_step_bench import FakeExecutor  # noqa: E402

from nori_jax.bench.workload import WorkloadConfig  # noqa: E402
from nori_jax.core.engine_core import EngineCore, EngineCoreRequest  # noqa: E402
from nori_jax.core.paging import PageAllocator  # noqa: E402
from nori_jax.core.plan_builder import PlanBuilder  # noqa: E402
from nori_jax.core.scheduler import Scheduler  # noqa: E402
from nori_jax.core.scheduler_config import SchedulerConfig  # noqa: E402
from nori_jax.sampling_params import SamplingParams  # noqa: E402

VOCAB = 128256


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-prompts", type=int, default=600)
    ap.add_argument("--num-pages", type=int, default=10164, help="the KV pool, in pages")
    ap.add_argument("--max-num-seqs", type=int, default=1024)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=8192)
    args = ap.parse_args()
    cfg = SchedulerConfig(
        max_model_len=args.max_model_len,
        page_size=args.page_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    pool = PageAllocator(args.num_pages, cfg.page_size, cfg.enable_prefix_caching)
    scheduler = Scheduler(cfg, pool)
    builder = PlanBuilder(
        cfg.max_num_seqs, cfg.max_pages_per_seq, cfg.page_size, args.num_pages, scheduler.buckets,
        VOCAB,
    )  # fmt: skip
    core = EngineCore(scheduler, builder, FakeExecutor(cfg.max_num_seqs))
    workload = WorkloadConfig(num_prompts=args.num_prompts)
    rng, _ = workload.streams()
    ins, outs = workload.lengths(args.num_prompts, rng)
    for i, (n, m) in enumerate(zip(ins, outs, strict=True)):
        params = SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)
        prompt = rng.integers(10, VOCAB - 10, n).tolist()
        core.add_request(EngineCoreRequest(f"r{i}", prompt, params, 0, [], time.monotonic()))
    while core.has_unfinished():
        core.step()
    core.drain()
    print(
        f"{args.num_prompts} requests, {sum(ins)} prompt / {sum(outs)} output tokens, "
        f"{args.num_pages} pages: {core.step_times.steps} launches, "
        f"{scheduler.counters.num_preemptions} preemptions"
    )
    print(f"{'bucket':>7} {'kind':<8} {'launches':>9} {'tokens':>8}")
    for row in core.step_shapes.rows():
        print(
            f"{row['bucket']:>7} {row['kind']:<8} {row['launches']:>9} "
            f"{row['tokens_per_launch']:>8.1f}"
        )


if __name__ == "__main__":
    main()
