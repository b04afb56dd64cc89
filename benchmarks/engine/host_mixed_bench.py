"""Host work per engine step over the whole offline workload, with a fake device (no JAX, CPU only).

    python benchmarks/engine/host_mixed_bench.py [--num-prompts 2000] [--max-num-seqs 1024]

`host_step_bench.py` times pure decode steps; this one runs `bench offline`'s lognormal workload
(the same draw: `--bench-seed`, input mu 6.2 sigma 0.8 clipped 6144, output mu 5.5 sigma 0.7
clipped 2048, every request queued at t=0) from the first admission to the last finish, so most
steps are mixed: ~1,000 decodes plus prefill chunks, admissions and finishes. It drives the same
calls `LLMEngine.step` makes (overlapped scheduling: plan and launch step N+1, then fetch and
post-process step N), final-only outputs as `LLM.generate` asks, and times the host stages:
schedule (Scheduler.schedule and the batch events), plan (PlanBuilder.build), update
(Scheduler.update) and outputs (EngineCoreOutputs, the output processor and the metrics). The fake
device returns random tokens at once, so this is the host's share alone.
"""

from __future__ import annotations

import argparse
import time

from nori_jax.bench.offline import OfflineConfig, draw_requests
from nori_jax.bench.workload import WorkloadConfig
from nori_jax.core.engine_core import EngineCoreRequest
from nori_jax.core.output_processor import OutputProcessor
from nori_jax.core.outputs import EngineCoreOutputs
from nori_jax.core.scheduler_config import SchedulerConfig
from nori_jax.metrics import EngineMetrics
from nori_jax.sampling_params import SamplingParams

# The same fake device as the decode-only bench beside this script (its directory is on sys.path).
from host_step_bench import VOCAB, fake_core  # noqa: E402  isort: skip

EOS = [2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=2000)
    p.add_argument("--bench-seed", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=1024)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--num-pages", type=int, default=68533, help="the 135M engine's pool on an H200")
    p.add_argument("--no-prefix-caching", action="store_true")
    args = p.parse_args()

    cfg = SchedulerConfig(
        max_model_len=args.max_model_len,
        page_size=args.page_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=not args.no_prefix_caching,
    )
    core = fake_core(cfg, args.num_pages)
    scheduler, builder, executor = core.scheduler, core.builder, core.executor
    processor = OutputProcessor(None)
    metrics = EngineMetrics()

    workload = WorkloadConfig(num_prompts=args.num_prompts, seed=args.bench_seed)
    reqs = draw_requests(OfflineConfig(workload), VOCAB, cfg.max_model_len)
    for i, (prompt, n_out) in enumerate(zip(reqs.prompts, reqs.output_lens, strict=True)):
        params = SamplingParams(max_tokens=n_out, temperature=0.0, ignore_eos=True)
        rid = f"r{i}"
        # As LLMEngine.add_request: the core in this process hands each finish its whole output.
        req = EngineCoreRequest(rid, prompt, params, i, EOS, time.monotonic(), final_token_ids=True)
        core.add_request(req)
        processor.add(rid, None, prompt, params, tuple(EOS), stream=False, final_ids_from_core=True)

    # EngineCore.launch_step / complete_step and LLMEngine._process, stage by stage.
    clock = time.perf_counter
    totals = dict(schedule=0.0, plan=0.0, update=0.0, outputs=0.0)
    # The same split over the steps of a full batch alone (at least half of max_num_seqs decoding).
    full_totals, full_steps, full_rows = dict.fromkeys(totals, 0.0), 0, 0
    steps = decode_rows = prefill_rows = finished = 0
    in_flight = None
    start = clock()
    while scheduler.has_unfinished() or in_flight is not None:
        t0 = clock()
        scheduled = scheduler.schedule()
        failed = core._apply_batch_events(scheduled) if scheduled is not None else []
        t1 = clock()
        launched, is_full = None, False
        if scheduled is not None:
            plan = builder.build(scheduled)
            launched = (scheduled, executor.launch(plan))
            steps += 1
            decode_rows += scheduled.num_decodes
            prefill_rows += len(scheduled.prefills)
            is_full = scheduled.num_decodes >= cfg.max_num_seqs // 2
            full_steps += is_full
            full_rows += scheduled.num_decodes if is_full else 0
        t2 = clock()
        done, in_flight = in_flight, launched
        upd = None
        if done is not None:
            upd = scheduler.update(done[0], *executor.fetch(done[1]))
        t3 = clock()
        out = core._outputs(upd) if upd is not None else EngineCoreOutputs.empty()
        out.finished.extend(failed)
        out.stats = core._stats(len(out.request_ids), t1 - t0, t3 - t0, int(launched is not None))
        outputs, ended = processor.process(out)
        assert not ended
        metrics.observe(out)
        finished += sum(o.finished for o in outputs)
        t4 = clock()
        for d in (totals, full_totals) if is_full else (totals,):
            d["schedule"] += t1 - t0
            d["plan"] += t2 - t1
            d["update"] += t3 - t2
            d["outputs"] += t4 - t3
    wall = clock() - start
    assert finished == args.num_prompts, (finished, args.num_prompts)

    def line(t: dict[str, float], n: int) -> str:
        per = {k: 1e3 * v / max(n, 1) for k, v in t.items()}
        return (
            ", ".join(f"{k} {v:.3f}" for k, v in per.items()) + f"; total {sum(per.values()):.3f}"
        )

    print(
        f"{args.num_prompts} requests, {steps} steps ({decode_rows / steps:.0f} decode rows, "
        f"{prefill_rows / steps:.2f} prefill chunks per step), {scheduler.counters.num_preemptions}"
        f" preemptions; loop wall {1e3 * wall / steps:.3f} ms per step"
    )
    print(f"all steps, host ms per step: {line(totals, steps)}")
    print(
        f"{full_steps} full steps ({full_rows / max(full_steps, 1):.0f} decode rows), host ms per "
        f"step: {line(full_totals, full_steps)}"
    )


if __name__ == "__main__":
    main()
