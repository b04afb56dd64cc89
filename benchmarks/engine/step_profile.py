"""Where an engine step's time goes: host stages against device kernels, from a profiler trace.

    python benchmarks/engine/step_profile.py --config h200-throughput --model smollm2-135m \
        --load-format dummy --batch 128 --context 1024 --steps 40 [--trace-dir DIR] [--json F]

Fills the engine with `--batch` requests of `--context` random prompt tokens, waits until every
one is decoding, then runs `--steps` decode steps twice: once timed by the engine's own stage
clocks (schedule / launch / wait / postprocess), once under `jax.profiler.trace`. From the trace it
reports, per step: the number of device kernels, the device busy time (union of kernel
intervals), and the top kernels by total time. Device busy time well below the step's wall time
means the host (dispatch) bounds the step; close to it means the device does.
Run it under different XLA_FLAGS (e.g. command buffers on or off) to compare.

`--batch 16,64,1024` profiles each size in turn in one engine (the requests of one size are
aborted before the next fills it); `--no-trace` skips the traced pass. With
`--no-async-scheduling` every launch finds the device idle, so the launch clock is host work
alone; with overlapped steps (the default) a launch at large batches also waits for the device.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import sys
import tempfile
import time

import numpy as np

from nori_jax.engine import LLMEngine
from nori_jax.engine_args import add_engine_args, engine_config_from_args
from nori_jax.sampling_params import SamplingParams

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from trace_events import busy_ns, device_kernels, host_events  # noqa: E402


def fill_decoding(engine: LLMEngine, batch: int, context: int, stream: bool, seed: int = 0) -> None:
    """Admit `batch` requests and step until each has its first token (all now decode)."""
    vocab = engine.model.config.vocab_size
    rng = np.random.default_rng(seed)
    params = SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True)
    pending = set()
    for _ in range(batch):
        prompt = rng.integers(10, vocab - 10, context).tolist()
        pending.add(engine.add_request(None, prompt, params, stream=stream))
    while pending:
        engine.step()
        pending = {r for r in pending if not engine.scheduler.requests[r].output_token_ids}


def time_outputs(engine: LLMEngine) -> list[float]:
    """Wrap the engine's output processor so its host time per call is recorded (seconds)."""
    spent: list[float] = []
    process = engine.processor.process

    def timed(outs):
        t0 = time.perf_counter()
        try:
            return process(outs)
        finally:
            spent.append(time.perf_counter() - t0)

    engine.processor.process = timed
    return spent


def profile(engine: LLMEngine, args, batch: int, trace_dir: str | None) -> dict:
    """Fill the engine with `batch` decoding requests, time `args.steps` steps (and trace as many
    unless `trace_dir` is None), then abort the requests."""
    import jax

    fill_decoding(engine, batch, args.context, args.stream)
    outputs_spent = time_outputs(engine)
    for _ in range(5):  # settle: every row is a decode row from here on
        engine.step()

    st0 = engine.step_times
    before = (st0.steps, st0.schedule, st0.launch, st0.wait, st0.postprocess)
    lt0 = dataclasses.replace(engine.runner.launch_times)
    outputs_spent.clear()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    wall = (time.perf_counter() - t0) / args.steps
    st = engine.step_times
    n = st.steps - before[0]
    stages = {
        name: 1e3 * (getattr(st, name) - before[i + 1]) / n
        for i, name in enumerate(("schedule", "launch", "wait", "postprocess"))
    }
    stages["outputs"] = 1e3 * sum(outputs_spent) / n  # the output processor, outside the core
    lt = engine.runner.launch_times
    launch_parts = {
        f.name: 1e3 * (getattr(lt, f.name) - getattr(lt0, f.name)) / n
        for f in dataclasses.fields(lt)
    }
    result = {
        "batch": batch,
        "context": args.context,
        "steps": args.steps,
        "async_scheduling": engine.config.async_scheduling,
        "wall_ms_per_step": 1e3 * wall,
        "stage_ms_per_step": stages,
        "launch_ms_per_step": launch_parts,
    }
    line = (
        f"batch {batch} x context {args.context}: {result['wall_ms_per_step']:.2f} ms/step "
        f"wall ({', '.join(f'{k} {v:.2f}' for k, v in stages.items())}; launch = "
        f"{', '.join(f'{k} {v:.2f}' for k, v in launch_parts.items())})"
    )
    if trace_dir is not None:
        with jax.profiler.trace(trace_dir):
            t1 = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            engine.drain()
            traced_wall = (time.perf_counter() - t1) / args.steps
        result.update(trace_summary(trace_dir, args.steps, args.top))
        result["traced_wall_ms_per_step"] = 1e3 * traced_wall
        line += (
            f"; traced {result['traced_wall_ms_per_step']:.2f} ms/step, "
            f"{result['kernels_per_step']:.0f} kernels/step, device busy "
            f"{result['device_busy_ms_per_step']:.2f} ms/step"
        )
    del engine.processor.process  # time_outputs' wrapper: the next size makes its own
    engine.drain()
    for rid in list(engine.scheduler.requests):
        engine.abort(rid)
    engine.drain()
    print(line, flush=True)
    if trace_dir is not None:
        for k in result["top_kernels"]:
            print(
                f"  {k['ms_per_step']:8.3f} ms/step {k['calls_per_step']:6.1f} calls "
                f"{k['mean_us']:8.1f} us  {k['name']}"
            )
        print("host events (nested events overlap):")
        for k in result["top_host_events"]:
            print(
                f"  {k['ms_per_step']:8.3f} ms/step {k['calls_per_step']:6.1f} calls  "
                f"[{k['thread']}] {k['name']}"
            )
    return result


def trace_summary(trace_dir: str, steps: int, top: int) -> dict:
    events = device_kernels(trace_dir)
    host_by_name: dict[tuple[str, str], list[int]] = collections.defaultdict(list)
    for thread, name, _, dur in host_events(trace_dir):
        host_by_name[(thread[:30], name[:80])].append(dur)
    by_name: dict[str, list[int]] = collections.defaultdict(list)
    for name, _, dur in events:
        by_name[name].append(dur)
    # The trace holds steps + the one in flight before it (async scheduling): per step ~ / steps.
    return {
        "kernels_per_step": len(events) / steps,
        "device_busy_ms_per_step": busy_ns(events) / 1e6 / steps,
        "device_kernel_sum_ms_per_step": sum(e[2] for e in events) / 1e6 / steps,
        "top_kernels": [
            {
                "name": name[:90],
                "ms_per_step": sum(d) / 1e6 / steps,
                "calls_per_step": len(d) / steps,
                "mean_us": sum(d) / len(d) / 1e3,
            }
            for name, d in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
        ],
        "top_host_events": [
            {
                "thread": thread,
                "name": name,
                "ms_per_step": sum(d) / 1e6 / steps,
                "calls_per_step": len(d) / steps,
            }
            for (thread, name), d in sorted(host_by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_args(parser)
    parser.add_argument("--batch", default="128", help="decoding sequences; a comma list runs each")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument(
        "--trace-dir", default=None, help="where the traces go (default: fresh temp dirs)"
    )
    parser.add_argument("--no-trace", action="store_true", help="the timed pass only")
    parser.add_argument(
        "--late-copy",
        action="store_true",
        help="no device-to-host copy started at launch: fetch copies the samples",
    )
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--json", default=None, help="write the result here")
    parser.add_argument(
        "--stream",
        action="store_true",
        help="stream every request (text deltas per step, as the in-process server does); by "
        "default only finished outputs, as LLM.generate and the engine-core process",
    )
    args = parser.parse_args()

    engine = LLMEngine(engine_config_from_args(args))
    engine.runner.copy_back_early = not args.late_copy
    results = []
    for batch in [int(b) for b in args.batch.split(",")]:
        trace_dir = None
        if not args.no_trace:
            # A fresh directory: device_kernels reads every trace under it, and earlier runs' count.
            base = args.trace_dir or tempfile.gettempdir()
            os.makedirs(base, exist_ok=True)
            trace_dir = tempfile.mkdtemp(prefix=f"nori_step_trace_{batch}_", dir=base)
        results.append(profile(engine, args, batch, trace_dir))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results[0] if len(results) == 1 else results, f, indent=1)


if __name__ == "__main__":
    main()
