"""Data-parallel replicas in one process (`LLM(mesh=MeshConfig(data=2))`): the single engine's
greedy tokens, each replica on its own device, launches before fetches, routing by prefix and by
load, one metrics view, no compile after warm-up, new weights on every replica, and the same
engine under AsyncEngine.

One subprocess with two CPU devices (the device count is fixed when JAX starts) runs every case;
each test reads its part of the result.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from cpu_devices import cpu_devices_env

SCRIPT = textwrap.dedent(
    """
    import asyncio, json, sys
    import jax
    from prometheus_client import generate_latest
    from nori_jax import LLM, MeshConfig, SamplingParams
    from nori_jax.async_engine import AsyncEngine
    from nori_jax.replicated_engine import ReplicatedEngine

    path = sys.argv[1]
    kw = dict(dtype="float32", page_size=16, num_pages=48, max_num_seqs=4,
              max_num_batched_tokens=64, max_model_len=128)
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    prompts = [[5, 17, 33, 101, 7], list(range(40, 70)), list(range(100, 150)), [9, 8] * 12,
               [3] * 40]
    reference = LLM(path, **kw)
    single = [o.token_ids for o in reference.generate(prompts, greedy)]
    llm = LLM(path, mesh=MeshConfig(data=2), **kw)
    engine = llm.engine
    out = {"type": type(engine).__name__, "single": single}
    out["dp"] = [o.token_ids for o in llm.generate(prompts, greedy)]
    out["devices"] = [sorted(d.id for d in r.runner.kv_pages[0].devices()) for r in engine.replicas]
    out["param_devices"] = [
        sorted({d.id for leaf in jax.tree.leaves(r.model.state) for d in leaf.devices()})
        for r in engine.replicas]

    # The order of device calls in one step of both replicas.
    calls = []
    for i, core in enumerate(engine.cores):
        ex = core.executor
        def wrap(name, fn, i=i):
            def f(x):
                calls.append(f"{name}{i}")
                return fn(x)
            return f
        ex.launch, ex.fetch = wrap("launch", ex.launch), wrap("fetch", ex.fetch)

    def run(batch):
        ids = [engine.add_request(None, p, greedy, stream=False) for p in batch]
        placed = [engine.replica_of(r) for r in ids]
        done = {}
        while len(done) < len(ids):
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = o.token_ids
        engine.drain()
        return placed, [done[r] for r in ids]

    system = list(range(60, 60 + 32))  # two full pages shared
    shared = [system + [200 + i, 7] for i in range(4)]
    before = [m.as_dict()["nori:prefix_cache_hits_total"] for m in engine.metrics.replicas]
    # The first one alone, so its pages are cached before the others arrive.
    first_placed, first_tokens = run(shared[:1])
    placed, tokens = run(shared[1:])
    out["shared_replicas"], out["shared_tokens"] = first_placed + placed, first_tokens + tokens
    out["shared_single"] = [o.token_ids for o in reference.generate(shared, greedy)]
    out["prefix_hits"] = [m.as_dict()["nori:prefix_cache_hits_total"] - b
                          for m, b in zip(engine.metrics.replicas, before)]
    distinct = [list(range(k, k + 20)) for k in (10, 50, 90, 130)]
    calls.clear()
    out["distinct_replicas"], _ = run(distinct)
    out["calls"] = calls[:6]
    out["recompiles"] = engine.num_recompiles
    out["metrics"] = {k: v for k, v in llm.get_metrics().items() if k != "replicas"}
    out["per_replica_requests"] = [
        sum(r["nori:request_success_total"].values()) for r in llm.get_metrics()["replicas"]]
    out["exposition"] = generate_latest(engine.metrics.registry).decode()
    out["free_pages"] = [c.scheduler.allocator.num_free_pages for c in engine.cores]
    out["router_load"] = engine.router.load
    out["shape_launches"] = sum(t.launches for t in engine.step_shapes.by_shape.values())
    out["shape_tokens"] = sum(t.tokens for t in engine.step_shapes.by_shape.values())
    out["step_times"] = [engine.step_times.steps, engine.step_times.tokens]
    out["replica_launches"] = [sum(t.launches for t in c.step_shapes.by_shape.values())
                               for c in engine.cores]


    async def serve_one():
        a = AsyncEngine(engine)
        a.start()
        try:
            s = await a.add_request(prompts[1], greedy)
            return (await s.result()).token_ids
        finally:
            await a.shutdown(5)
    out["async"] = asyncio.run(serve_one())

    # New weights on both replicas (every tensor's rows reversed): the single engine's tokens
    # on the same new weights, each replica's parameters still on its own device.
    import numpy as np
    from nori_jax.weights.safetensors_dir import iter_safetensors
    from pathlib import Path
    new = {n: np.ascontiguousarray(a[::-1]) for n, a in iter_safetensors(Path(path))}
    reference.update_weights(new)
    llm.update_weights(new)
    out["updated_single"] = [o.token_ids for o in reference.generate(prompts, greedy)]
    out["updated_dp"] = [o.token_ids for o in llm.generate(prompts, greedy)]
    out["updated_param_devices"] = [
        sorted({d.id for leaf in jax.tree.leaves(r.model.state) for d in leaf.devices()})
        for r in engine.replicas]
    llm.sleep()  # both replicas' pages and weights off their devices, then back
    llm.wake_up()
    out["woken_dp"] = [o.token_ids for o in llm.generate(prompts, greedy)]
    out["updated_recompiles"] = engine.num_recompiles
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def result(hf_checkpoints) -> dict:
    env = cpu_devices_env(2)
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(hf_checkpoints["llama"])],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_two_replicas_give_the_single_engine_tokens(result) -> None:
    assert result["type"] == "ReplicatedEngine"
    assert result["dp"] == result["single"]
    assert result["shared_tokens"] == result["shared_single"]
    assert result["async"] == result["single"][1]


def test_new_weights_and_sleep_reach_every_replica(result) -> None:
    assert result["updated_single"] != result["single"]
    assert result["updated_dp"] == result["updated_single"] == result["woken_dp"]
    assert result["updated_param_devices"] == [[0], [1]]
    assert result["updated_recompiles"] == 0


def test_each_replica_holds_its_own_device(result) -> None:
    assert result["devices"] == [[0], [1]]
    assert result["param_devices"] == [[0], [1]]


def test_every_replica_launches_before_any_is_fetched(result) -> None:
    # Overlapped scheduling: the first step only launches, the next fetches the first.
    assert result["calls"] == ["launch0", "launch1", "launch0", "launch1", "fetch0", "fetch1"]


def test_routing_keeps_a_shared_prefix_on_one_replica_and_spreads_the_rest(result) -> None:
    assert len(set(result["shared_replicas"])) == 1
    owner = result["shared_replicas"][0]
    assert result["prefix_hits"][owner] > 0 and result["prefix_hits"][1 - owner] == 0
    assert sorted(result["distinct_replicas"]) == [0, 0, 1, 1]


def test_no_compile_after_warm_up_and_nothing_left_behind(result) -> None:
    assert result["recompiles"] == 0 and result["metrics"]["nori:recompiles_total"] == 0
    assert result["router_load"] == [0, 0]
    assert result["free_pages"] == [47, 47]  # every page but the null page back in the pool


def test_step_shapes_hold_every_replica_launch(result) -> None:
    assert [result["shape_launches"], result["shape_tokens"]] == result["step_times"]
    assert sum(result["replica_launches"]) == result["shape_launches"]
    assert all(n > 0 for n in result["replica_launches"])


def test_one_metrics_view_labels_each_replica(result) -> None:
    text = result["exposition"]
    assert 'nori:generation_tokens_total{replica="0"}' in text
    assert 'nori:generation_tokens_total{replica="1"}' in text
    assert 'nori:recompiles_total{replica="1"} 0.0' in text
    m = result["metrics"]
    # 5 + 4 + 4 requests of 10 tokens, summed over the replicas; each replica served some.
    assert m["nori:request_success_total"]["length"] == 13
    assert m["nori:generation_tokens_total"] == 130
    assert sum(result["per_replica_requests"]) == 13 and min(result["per_replica_requests"]) > 0


def test_clear_errors_for_layouts_this_process_cannot_run() -> None:
    from nori_jax import LLM, EngineConfig, LLMEngine, MeshConfig
    from nori_jax.dp_client import DataParallelClient

    dp2 = EngineConfig.from_yaml("tiny-cpu", mesh=MeshConfig(data=2))
    with pytest.raises(ValueError, match="LLMEngine runs one replica"):
        LLMEngine(dp2)
    with pytest.raises(ValueError, match="needs 2 devices; 1 available"):
        LLM.from_config(dp2)  # this test process has one CPU device
    with pytest.raises(ValueError, match="2 or more colocated replicas"):
        DataParallelClient(EngineConfig.from_yaml("tiny-cpu"))


@pytest.mark.parametrize("bound, second", [(0, 1), (1_000_000, 0)])
def test_the_meshs_prefix_affinity_bound_reaches_the_in_process_router(
    monkeypatch, bound, second
) -> None:
    """ReplicatedEngine's router takes the mesh's bound: the cases of the served client's test
    (tests/serve/test_dp_client_failover.py), over replicas that build nothing."""
    from types import SimpleNamespace

    from nori_jax import EngineConfig, SamplingParams, replicated_engine

    class Core:
        def add_request(self, request) -> None:
            pass

    def build(config, replica, tokenizer=None) -> SimpleNamespace:
        return SimpleNamespace(
            core=Core(),
            model=SimpleNamespace(config=SimpleNamespace(vocab_size=1000)),
            runner=None,
            tokenizer=None,
            max_model_len=128,
            scheduler_config=config.scheduler,
            load_seconds=0.0,
            config_info={},
            eos_token_ids=[],
        )

    monkeypatch.setattr(replicated_engine, "build_engine", build)
    mesh = {"data": 2, "prefix_affinity_max_imbalance_tokens": bound}
    engine = replicated_engine.ReplicatedEngine(
        EngineConfig.from_dict({"page_size": 16, "mesh": mesh})
    )
    shared = list(range(1, 2 * 16 + 1))  # two full pages
    params = SamplingParams(max_tokens=4)
    ids = [engine.add_request(None, shared + [tail], params) for tail in (100, 200)]
    assert [engine.replica_of(r) for r in ids] == [0, second]
