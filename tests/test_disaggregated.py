"""Prefill/decode disaggregation on CPU meshes: prefill and decode replicas on their own devices,
each request's KV pages moved between their pools after its first token.

One subprocess (the CPU device count is fixed when JAX starts) runs every layout once and reports;
the assertions below read its report. Against the single-device engine: the same tokens (greedy,
and seeded sampling), the same KV values in the decode engine's pages as in the single engine's
for the same request, no program built after warm-up, an injected transfer failure retried, and
the transfer metrics.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from cpu_devices import cpu_devices_env

SCRIPT = textwrap.dedent(
    """
    import asyncio, json
    import jax
    import numpy as np
    from nori_jax import LLM, MeshConfig, SamplingParams
    from nori_jax.async_engine import AsyncEngine

    kw = dict(load_format="dummy", dtype="float32", page_size=16, num_pages=48, max_num_seqs=4,
              max_num_batched_tokens=32, max_model_len=128)
    prompts = [[5, 17, 33, 101, 7], list(range(40, 70)), list(range(3, 40)), list(range(100, 164))]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    params = [greedy, greedy, seeded, greedy]
    fresh = list(range(180, 230))  # a prompt no engine has seen: its KV must move
    report = {"devices": len(jax.devices())}

    def tokens(llm):
        return [o.token_ids for o in llm.generate(prompts, params)]

    def top_of(llm):
        top = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)
        return llm.generate([prompts[2]], top)[0].top_logprobs

    def scored_of(llm):
        # prompt logprobs (computed on the prefill side) and a penalized request (recomputed on
        # the decode side, which builds its own counts)
        asking = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
        penalized = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                   repetition_penalty=1.5, presence_penalty=0.5)
        out = llm.generate([prompts[3], prompts[1]], [asking, penalized])
        return {"prompt": out[0].prompt_logprobs[1:], "top": out[0].prompt_top_logprobs[1:],
                "penalized": out[1].token_ids}

    def kv_of(llm, schedulers_and_runners, prompt):
        # Run one request alone; return its KV, token by token, from the pages that held it.
        eng = llm.engine
        rid = eng.add_request(None, prompt, greedy, stream=False)
        held = None
        while eng.has_unfinished_requests():
            eng.step()
            for sched, runner in schedulers_and_runners:
                r = sched.requests.get(rid)
                if r is not None and r.pages:
                    held = (list(r.pages), runner)
        eng.drain()
        pages, runner = held
        n = len(prompt) + greedy.max_tokens - 1  # the last token's KV is never written
        per_layer = []
        for layer in runner.kv_pages:
            a = np.asarray(layer)[pages]  # [P, KVH, 2, page_size, D]
            per_layer.append(a.transpose(0, 3, 1, 2, 4).reshape(-1, *a.shape[1:3], a.shape[4])[:n])
        return np.stack(per_layer)

    single = LLM("tiny-llama", **kw)
    report["single"] = tokens(single)
    report["single_top"] = top_of(single)
    report["single_scored"] = scored_of(single)
    kv_single = kv_of(single, [(single.engine.scheduler, single.engine.runner)], fresh)

    layouts = {"pd-1-1": "pd-1-1", "pd-2-2": "pd-2-2",
               "pd-1-1-tp2": MeshConfig(prefill=1, decode=1, model=2)}
    for name, mesh in layouts.items():
        llm = LLM("tiny-llama", mesh=mesh, **kw)
        core = llm.engine.core
        out = {"tokens": tokens(llm)}
        decode_sides = [(c.scheduler, c.executor.runner) for c in core.decode]
        kv = kv_of(llm, decode_sides, fresh)
        out["kv_equal"] = bool(np.array_equal(kv, kv_single))
        out["kv_max_diff"] = float(np.abs(kv - kv_single).max())
        out["kv_spec"] = str(core.decode[0].executor.runner.kv_pages[0].sharding.spec)
        out["prefill_used"] = [c.step_times.tokens > 0 for c in core.prefill]
        out["decode_used"] = [c.step_times.tokens > 0 for c in core.decode]
        out["shape_kinds"] = [sorted({s.kind for c in side for s in c.step_shapes.by_shape})
                              for side in (core.prefill, core.decode)]
        out["shape_launches"] = sum(t.launches for t in core.step_shapes.by_shape.values())
        out["steps"] = core.step_times.steps
        out["decode_devices"] = [
            sorted(d.id for d in c.executor.runner.kv_pages[0].sharding.device_set)
            for c in core.decode
        ]
        if name == "pd-1-1":
            real, calls = core.mover.move, []
            def flaky(*args):
                calls.append(args)
                if len(calls) == 1:
                    raise RuntimeError("injected transfer failure")
                return real(*args)
            core.mover.move = flaky
            out["after_failure"] = tokens(llm)
            core.mover.move = real
            out["bytes_per_page"] = core.mover.bytes_per_page
            # Pages of every request run here, as if the decode side cached nothing.
            out["pages_uncached"] = sum(-(-len(p) // 16) for p in prompts * 2 + [fresh, prompts[1]])

            async def serve_one():
                engine = AsyncEngine(llm.engine)
                engine.start()
                try:
                    last = None
                    async for o in engine.generate(prompts[1], greedy):
                        last = o
                    return last.token_ids
                finally:
                    engine.stop()
            out["async"] = asyncio.run(serve_one())
        out["recompiles"] = llm.engine.num_recompiles
        out["metrics"] = llm.get_metrics()
        if name == "pd-1-1":  # after the metrics, which count this layout's transfers
            out["top"] = top_of(llm)
            out["scored"] = scored_of(llm)
        report[name] = out
    # Multi-step decode on the decode side (the prefill side hands each request off first).
    llm = LLM("tiny-llama", mesh="pd-1-1", num_scheduler_steps=4, **kw)
    report["pd-1-1-multi-step"] = {
        "tokens": tokens(llm),
        "recompiles": llm.engine.num_recompiles,
        "multi_step_launches": [c.step_times.multi_step_launches for c in llm.engine.core.decode],
    }
    print(json.dumps(report))
    """
)


@pytest.fixture(scope="module")
def report():
    env = cpu_devices_env(4)
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


LAYOUTS = ["pd-1-1", "pd-2-2", "pd-1-1-tp2"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_tokens_match_the_single_device_engine(report, layout):
    assert report["devices"] == 4
    assert report[layout]["tokens"] == report["single"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_decode_pages_hold_the_kv_computed_in_place(report, layout):
    r = report[layout]
    if layout.endswith("tp2"):
        # Tensor parallelism sums the row-split projections in another order: float32 rounding.
        assert r["kv_max_diff"] < 1e-5
    else:  # the same programs on both sides: bit for bit
        assert r["kv_equal"], f"max difference {r['kv_max_diff']}"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_nothing_compiles_after_warm_up(report, layout):
    r = report[layout]
    assert r["recompiles"] == 0 and r["metrics"]["nori:recompiles_total"] == 0


def test_top_logprobs_cross_from_the_prefill_to_the_decode_side(report):
    """The first token's top logprobs come from the prefill side, the rest from the decode side:
    together those of the single-device engine."""
    want, got = report["single_top"], report["pd-1-1"]["top"]
    assert len(got) == len(want) == 6
    assert [[t for t, _ in p] for p in got] == [[t for t, _ in p] for p in want]
    np.testing.assert_allclose(
        [[v for _, v in p] for p in got], [[v for _, v in p] for p in want], atol=1e-5
    )


def test_prompt_logprobs_and_penalties_across_the_split(report):
    """Prompt logprobs come from the prefill side; a penalized request is recomputed on the
    decode side: both as the single-device engine gives them."""
    want, got = report["single_scored"], report["pd-1-1"]["scored"]
    np.testing.assert_allclose(got["prompt"], want["prompt"], atol=1e-5)
    assert [[t for t, _ in p] for p in got["top"]] == [[t for t, _ in p] for p in want["top"]]
    assert got["penalized"] == want["penalized"]


def test_multi_step_decode_on_the_decode_side_gives_the_same_tokens(report):
    r = report["pd-1-1-multi-step"]
    assert r["tokens"] == report["single"] and r["recompiles"] == 0
    assert r["multi_step_launches"][0] > 0


def test_every_replica_takes_work_on_its_own_devices(report):
    r = report["pd-2-2"]
    assert r["prefill_used"] == [True, True] and r["decode_used"] == [True, True]
    assert r["decode_devices"] == [[2], [3]]  # prefill replicas first: devices 0 and 1
    tp = report["pd-1-1-tp2"]
    assert tp["decode_devices"] == [[2, 3]] and "model" in tp["kv_spec"]
    # Prefill replicas run prompts only, decode replicas decode only; the merged view holds both.
    assert r["shape_kinds"] == [["prefill"], ["decode"]]
    assert r["shape_launches"] == r["steps"]


def test_an_injected_transfer_failure_is_retried_with_the_same_tokens(report):
    r = report["pd-1-1"]
    assert r["after_failure"] == report["single"]
    transfers = r["metrics"]["nori:kv_transfers_total"]
    assert transfers["failed"] == 1
    assert transfers["ok"] == 2 * len(report["single"]) + 2  # two batches, kv_of, the async one


def test_transfer_stage_metrics(report):
    m = report["pd-1-1"]["metrics"]
    ok = m["nori:kv_transfers_total"]["ok"]
    assert m["nori:request_transfer_time_seconds"]["count"] == ok
    assert m["nori:request_transfer_time_seconds"]["sum"] > 0
    # Whole pages move, but not the full prompt pages the decode side already caches (the second
    # batch repeats the first's prompts).
    r = report["pd-1-1"]
    moved = m["nori:kv_transfer_bytes_total"]
    assert moved > 0 and moved % r["bytes_per_page"] == 0
    assert moved < r["pages_uncached"] * r["bytes_per_page"]
    assert m["nori:request_prefill_time_seconds"]["count"] > 0
    assert m["nori:request_decode_time_seconds"]["count"] > 0


def test_served_in_process_through_the_async_engine(report):
    assert report["pd-1-1"]["async"] == report["single"][1]
