"""`run-batch` against `bench offline` on the same requests, one engine, one process.

    python benchmarks/engine/batch_vs_offline.py --config h200-throughput --num-prompts 2000 \
        --result-json batch_vs_offline.json
    # CPU check of the script itself (tiny model, seconds):
    python benchmarks/engine/batch_vs_offline.py --config tiny-cpu --num-prompts 64 \
        --bench-seed 0 --memory-lines 2000

1. `bench offline`'s requests (the benchmark workload by default, docs/benchmarks.md,
   Conventions: the same flags, seed and lengths)
   run through `run_offline` (every request queued at once, token ids in, nothing decoded).
2. The same requests, written as an OpenAI batch file (/v1/completions, token-id prompts,
   max_tokens, greedy, ignore_eos), run through `run-batch`'s runner on the same engine: grain
   reading, pydantic validation, the server's response bodies, detokenization, durable output.
   The issue's bar: run-batch within 10% of offline output throughput.
3. Memory (`--memory-lines N`, default 20,000): an N-line batch file of one-token requests and
   one of N/10 lines; the process's peak RSS growth over each run (sampled every 20 ms) and the
   most lines grain read ahead. Bounded memory: the growth does not scale with N beyond the line
   index (24 bytes a line) and the read-ahead stays within --read-ahead.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
from pathlib import Path

from nori_jax.bench.offline import OfflineConfig, draw_requests, run_offline
from nori_jax.bench.workload import HelpFormatter, add_workload_args, workload_from_args
from nori_jax.engine_args import add_engine_args, engine_config_from_args

MODEL = "bench"


def write_batch(path: Path, prompts: list[list[int]], output_lens: list[int]) -> None:
    with path.open("w") as f:
        for i, (prompt, n) in enumerate(zip(prompts, output_lens, strict=True)):
            body = {"model": MODEL, "prompt": prompt, "max_tokens": n}
            body |= {"temperature": 0.0, "ignore_eos": True}
            row = {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions"}
            f.write(json.dumps(row | {"body": body}) + "\n")


class PeakRss:
    """The process's resident set, sampled by a thread: its peak over a `with` block."""

    def __init__(self) -> None:
        self.page = os.sysconf("SC_PAGE_SIZE")

    def now(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def __enter__(self) -> PeakRss:
        self.start = self.peak = self.now()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self.now())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.now())

    @property
    def growth_mib(self) -> float:
        return (self.peak - self.start) / 2**20


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    add_engine_args(p)
    add_workload_args(p, ("lognormal", "fixed"), "--bench-seed", warmup=16)
    g = p.add_argument_group("batch")
    g.add_argument(
        "--max-concurrency", type=int, default=None, help="run-batch's (default: 2 x max_num_seqs)"
    )
    g.add_argument("--read-ahead", type=int, default=256, help="run-batch's --read-ahead")
    g.add_argument(
        "--memory-lines", type=int, default=20_000, help="lines of the memory run (0: none)"
    )
    g.add_argument("--workdir", default=None, help="where the batch files go (default: a temp dir)")
    g.add_argument("--result-json", default=None, help="write the results here")
    args = p.parse_args()

    from nori_jax import LLMEngine
    from serve.batch.runner import BatchOptions, run_batch

    cfg = OfflineConfig(workload_from_args(args))
    engine = LLMEngine(engine_config_from_args(args))
    vocab = engine.tokenizer.vocab_size if engine.tokenizer is not None else 1000
    reqs = draw_requests(cfg, vocab, engine.max_model_len)
    offline = run_offline(engine, cfg, reqs)  # warms up first

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="batch_vs_offline_"))
    workdir.mkdir(parents=True, exist_ok=True)
    warm = cfg.workload.warmup_requests
    batch_in = workdir / "requests.jsonl"
    write_batch(batch_in, reqs.prompts[warm:], reqs.output_lens[warm:])
    opts = BatchOptions(
        MODEL,
        max_concurrency=args.max_concurrency,
        read_ahead=args.read_ahead,
        overwrite=True,
        progress=False,
    )
    with PeakRss() as rss:
        batch = run_batch(engine, str(batch_in), str(workdir / "out.jsonl"), opts)
    result = {
        "offline": {
            k: offline[k]
            for k in ("num_requests", "elapsed_s", "output_throughput", "total_token_throughput")
        },
        "run_batch": batch.as_dict() | {"rss_growth_mib": rss.growth_mib},
        "output_throughput_ratio": batch.as_dict()["output_throughput"]
        / offline["output_throughput"],
    }
    assert batch.run.failed == 0, "every benchmark request is valid"
    assert batch.run.completion_tokens == offline["output_tokens"], "the same work"

    if args.memory_lines:
        memory = {}
        for n in (args.memory_lines // 10, args.memory_lines):
            path = workdir / f"memory_{n}.jsonl"
            write_batch(path, [[1 + i % 97, 2, 3] for i in range(n)], [1] * n)
            with PeakRss() as rss:
                s = run_batch(engine, str(path), str(workdir / f"memory_{n}.out.jsonl"), opts)
            memory[n] = {
                "rss_growth_mib": rss.growth_mib,
                "max_read_ahead": s.max_read_ahead,
                "elapsed_s": s.elapsed_s,
                "request_throughput": s.as_dict()["request_throughput"],
            }
        result["memory"] = memory

    o, b = result["offline"], result["run_batch"]
    print(" run-batch vs bench offline ".center(64, "="))
    print(f"{'offline output tok/s':<44}{o['output_throughput']:>20.1f}")
    print(f"{'run-batch output tok/s':<44}{b['output_throughput']:>20.1f}")
    print(f"{'ratio (bar: >= 0.90)':<44}{result['output_throughput_ratio']:>20.3f}")
    print(f"{'run-batch most lines read ahead':<44}{b['max_read_ahead']:>20}")
    print(f"{'run-batch peak RSS growth (MiB)':<44}{b['rss_growth_mib']:>20.1f}")
    for n, m in result.get("memory", {}).items():
        row = f"{m['rss_growth_mib']:.1f} MiB, read-ahead {m['max_read_ahead']}"
        row += f", {m['request_throughput']:.0f} req/s"
        print(f"{f'memory, {n} lines':<30}{row:>34}")
    print("=" * 64)
    if args.result_json:
        Path(args.result_json).write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
