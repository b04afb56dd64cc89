"""Parallel sampling offline: `--num-prompts` distinct prompts, each `--n` times in a row (as the
server queues a request's n choices), all queued at t=0, sampled (temperature 1, a seed per
copy, `ignore_eos`).

    python benchmarks/engine/parallel_sampling.py --config h200-throughput --n 4 \
        --num-prompts 500 --input-len 1024 --output-len 256 [--no-wait-for-shared-prefix]

Reports total tok/s, the prompt tokens the engine computed (queried minus prefix-cache hits:
with the scheduler's `wait_for_shared_prefix` each prompt's full pages are computed once, without
it up to n times), TTFT percentiles over the copies, and the wall time. Run it with and without
`--no-wait-for-shared-prefix`, alternating, to see what the wait costs in TTFT and saves in
prefill. On a CPU the counts hold and the times say nothing of a GPU.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from nori_jax.engine import LLMEngine
from nori_jax.engine_args import add_engine_args, engine_config_from_args
from nori_jax.sampling_params import SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_args(p)
    p.add_argument("--n", type=int, default=4, help="copies of each prompt (choices)")
    p.add_argument("--num-prompts", type=int, default=500)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--prompt-seed", type=int, default=0, help="draws the prompts")
    p.add_argument("--result-json", default=None)
    args = p.parse_args()
    engine = LLMEngine(engine_config_from_args(args))
    rng = np.random.default_rng(args.prompt_seed)
    vocab = engine.model.config.vocab_size
    prompts = [
        rng.integers(10, vocab - 10, args.input_len).tolist() for _ in range(args.num_prompts)
    ]
    params = [
        SamplingParams(max_tokens=args.output_len, temperature=1.0, seed=i * args.n + c,
                       ignore_eos=True)
        for i in range(args.num_prompts) for c in range(args.n)
    ]  # fmt: skip
    copies = [prompt for prompt in prompts for _ in range(args.n)]
    warm = SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True)
    for _ in engine_run(engine, [rng.integers(10, vocab - 10, 64).tolist()], [warm]):
        pass
    before = engine.get_metrics()
    start = time.perf_counter()
    finished = list(engine_run(engine, copies, params))
    wall = time.perf_counter() - start
    after = engine.get_metrics()

    def delta(name: str) -> float:
        return after[f"nori:{name}_total"] - before[f"nori:{name}_total"]

    ttft = np.array([o.metrics.time_to_first_token for o in finished])
    prompt_tokens = len(copies) * args.input_len
    out_tokens = sum(len(o.token_ids) for o in finished)
    result = {
        "n": args.n,
        "num_prompts": args.num_prompts,
        "wait_for_shared_prefix": engine.config.scheduler.wait_for_shared_prefix,
        "wall_s": wall,
        "total_tok_s": (prompt_tokens + out_tokens) / wall,
        "output_tok_s": out_tokens / wall,
        "prompt_tokens": prompt_tokens,
        "prompt_tokens_computed": delta("prefix_cache_queries") - delta("prefix_cache_hits"),
        "ttft_p50_ms": float(np.percentile(ttft, 50) * 1e3),
        "ttft_p99_ms": float(np.percentile(ttft, 99) * 1e3),
        "num_preemptions": delta("num_preemptions"),
    }
    for key, value in result.items():
        print(f"{key:24s} {value:.4g}" if isinstance(value, float) else f"{key:24s} {value}")
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(result, f, indent=1)


def engine_run(engine: LLMEngine, prompts, params):
    """Queue every request at once, step until all finish; the finished outputs."""
    for prompt, p in zip(prompts, params, strict=True):
        engine.add_request(None, prompt, p, stream=False)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                yield out


if __name__ == "__main__":
    main()
