"""The step shapes an offline workload gives, from the real scheduler over a fake device (CPU).

    python benchmarks/engine/shape_mix.py [--num-prompts 600] [--num-pages 10164]
        [--max-num-seqs 1024] [--max-num-batched-tokens 8192] [--page-size 64]

Draws `bench offline`'s workload with its own function (the benchmark workload's lognormal lengths;
the same requests as `nori-jax bench offline --num-prompts N --bench-seed S`, warm-up left out),
queues every request at once and runs the engine core (Scheduler, PageAllocator, PlanBuilder) over
host_step_bench.py's fake executor, which samples random tokens, until all have finished. Prints the
launches by step shape (token bucket, kind) with their mean real tokens: how many steps of each
regime a GPU run will take, with `--num-pages` the pool that run has (its start-up log says it).
Counts only: the fake device takes no time, so what each shape costs is `bench offline`'s table on
the GPU.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from host_step_bench import VOCAB, fake_core  # noqa: E402

from nori_jax.bench.offline import OfflineConfig, draw_requests  # noqa: E402
from nori_jax.bench.workload import WorkloadConfig  # noqa: E402
from nori_jax.core.engine_core import EngineCoreRequest  # noqa: E402
from nori_jax.core.scheduler_config import SchedulerConfig  # noqa: E402
from nori_jax.sampling_params import SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-prompts", type=int, default=600)
    ap.add_argument("--bench-seed", type=int, default=0)
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
    core = fake_core(cfg, args.num_pages)
    workload = WorkloadConfig(num_prompts=args.num_prompts, seed=args.bench_seed)
    reqs = draw_requests(OfflineConfig(workload), VOCAB, cfg.max_model_len)
    for i, (prompt, n_out) in enumerate(zip(reqs.prompts, reqs.output_lens, strict=True)):
        params = SamplingParams(max_tokens=n_out, temperature=0.0, ignore_eos=True)
        core.add_request(EngineCoreRequest(f"r{i}", prompt, params, 0, [], time.monotonic()))
    while core.has_unfinished():
        core.step()
    core.drain()
    n_in, n_out = sum(map(len, reqs.prompts)), sum(reqs.output_lens)
    print(
        f"{args.num_prompts} requests, {n_in} prompt / {n_out} output tokens, "
        f"{args.num_pages} pages: {core.step_times.steps} launches, "
        f"{core.scheduler.counters.num_preemptions} preemptions"
    )
    print(f"{'bucket':>7} {'kind':<8} {'launches':>9} {'tokens':>8}")
    for row in core.step_shapes.rows():
        print(
            f"{row['bucket']:>7} {row['kind']:<8} {row['launches']:>9} "
            f"{row['tokens_per_launch']:>8.1f}"
        )


if __name__ == "__main__":
    main()
