"""Engines on several tensor-parallel layouts of one 8-device CPU mesh, run by
tests/test_tensor_parallel.py in a subprocess (the device count is fixed when JAX starts):

    python tests/tp_layouts.py TP_MODEL KERNEL_MODEL QWEN2     (XLA_FLAGS=...device_count=8)

(with NPROC=16 as tests/conftest.py sets it: interpret-mode kernels wait on XLA's CPU threads)

prints one JSON line: per engine its greedy tokens, recompiles, shardings and the collectives of
its compiled forward passes; per layout the Pallas kernel's attention step under shard_map against
the one-device step.
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections import Counter
from pathlib import Path

import interpret_callbacks  # (beside this script) as tests/conftest.py installs it
import jax
import jax.numpy as jnp
import numpy as np

from nori_jax import LLM, MeshConfig, SamplingParams
from nori_jax.executor.mesh import make_mesh
from nori_jax.models.llama import DOWN_PROJ_SCOPE, O_PROJ_SCOPE
from nori_jax.weights.safetensors_dir import iter_safetensors
from pallas_kernels import attention_step, attention_step_sharded
from pallas_kernels.ragged_paged_attention.pallas_attention import ragged_paged_attention_pallas

interpret_callbacks.install()

ENGINE = dict(
    dtype="float32",
    page_size=16,
    num_pages=24,
    max_num_seqs=2,
    max_num_batched_tokens=16,
    max_model_len=64,
)
# 5 tokens, and 20 (two prefill chunks beside the first prompt's decodes, across a page).
PROMPTS = [[5, 17, 33, 101, 7], list(range(40, 60))]
_COLLECTIVE = re.compile(
    r"\s(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\("
)


def collectives(hlo: str) -> dict[str, int]:
    """'kind:where' -> count over a compiled module; where is o_proj / down_proj when the op
    comes from those layers, else the op's own name (e.g. gather: the vocab-split embedding)."""
    found = Counter()
    for line in hlo.splitlines():
        if m := _COLLECTIVE.search(line):
            name = re.search(r'op_name="([^"]*)"', line)
            path = name.group(1).split("/") if name else ["?"]
            where = next((s for s in (O_PROJ_SCOPE, DOWN_PROJ_SCOPE) if s in path), path[-1])
            found[f"{m.group(1)}:{where}"] += 1
    return dict(found)


# Each way of asking for a layout: vLLM's keyword, a preset's name, a MeshConfig.
MESH_ARGS = {
    2: {"tensor_parallel_size": 2},
    4: {"mesh": "tp4"},
    8: {"mesh": MeshConfig(model=8)},
}


def engine(path: str, tp: int, backend: str, max_tokens: int, prompts=PROMPTS, **options) -> dict:
    started = time.perf_counter()
    mesh = MESH_ARGS.get(tp, {"mesh": MeshConfig(model=tp)})
    llm = LLM(path, attention_backend=backend, **mesh, **ENGINE, **options)
    kernel_programs = ragged_paged_attention_pallas._cache_size()
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    tokens = [o.token_ids for o in llm.generate(prompts, params)]
    # penalties (their per-slot tables and programs) and prompt logprobs (spare logit rows)
    scoring = SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=True,
        repetition_penalty=1.4,
        presence_penalty=0.3,
        prompt_logprobs=2,
    )
    scored = llm.generate(prompts[:1], scoring)[0]
    attn = llm.engine.model.state["layers"][0]["self_attn"]
    specs = {n: str(attn[n].get_value().sharding.spec) for n in attn if n.endswith("_proj")}
    updated = None
    if backend == "reference":  # new weights (every tensor's rows reversed) placed on the mesh
        new = {n: np.ascontiguousarray(a[::-1]) for n, a in iter_safetensors(Path(path))}
        llm.update_weights(new)
        updated = [o.token_ids for o in llm.generate(prompts, params)]
        attn = llm.engine.model.state["layers"][0]["self_attn"]
        after = {n: str(attn[n].get_value().sharding.spec) for n in attn if n.endswith("_proj")}
        assert after == specs, (specs, after)
    kv = llm.engine.runner.kv_pages[0]
    programs = llm.engine.runner.compiled_programs()
    return {
        "seconds": round(time.perf_counter() - started, 1),
        "mesh": llm.engine.config.mesh.model,
        "tokens": tokens,
        "updated_tokens": updated,
        "scored": {"tokens": scored.token_ids, "prompt_logprobs": scored.prompt_logprobs[1:]},
        "recompiles": llm.engine.num_recompiles,
        # Interpret-mode kernels run as host programs (sharded.py): none may be built after
        # warm-up either.
        "kernel_programs_built": ragged_paged_attention_pallas._cache_size() - kernel_programs,
        # the projections' shardings: fused q/k/v, or (k/v replicated) q and k apart
        "proj_specs": {
            name: str(attn[name].get_value().sharding.spec)
            for name in ("qkv_proj", "q_proj", "k_proj")
            if name in attn
        },
        # the launch's parameter arguments: [n, ...] stacks keep their rows' split
        "param_specs": sorted({str(a.sharding.spec) for a in llm.engine.runner._params}),
        "kv_shape": list(kv.shape),
        "kv_shard_shape": list(kv.addressable_shards[0].data.shape),
        "kv_spec": str(kv.sharding.spec),
        "free_pages": llm.engine.scheduler.allocator.num_free_pages,
        "num_pages": ENGINE["num_pages"],
        "collectives": {
            name: collectives(exe.as_text())
            for name, exe in programs.items()
            if name.startswith("bucket ")
        },
    }


def sharded_kernel_step(tp: int, hq: int, hkv: int) -> dict:
    """The Pallas attention step (interpret mode) split over `tp` devices against the unsharded
    reference step, on a decode row and a 15-token prefill chunk: the output and every page's
    K/V. Each layout gives a device 2 q heads and 1 kv head, the shapes of the kernel model's
    tp 2 engine, so one interpreted program serves them all."""
    started = time.perf_counter()
    d, ps = 16, ENGINE["page_size"]
    num_pages, t = ENGINE["num_pages"], ENGINE["max_num_batched_tokens"]
    mesh = make_mesh(MeshConfig(model=tp))
    rng = np.random.default_rng(tp)
    q, k, v = (jnp.asarray(rng.standard_normal((t, h, d)), jnp.float32) for h in (hq, hkv, hkv))
    pages = jnp.asarray(rng.standard_normal((num_pages, hkv, 2, ps, d)), jnp.float32)
    # Sequence 0 decodes at position 19 (pages 7, 3); sequence 1 prefills 15 tokens (page 5).
    kv_lens = jnp.array([20, 15], jnp.int32)
    page_table = jnp.array([[7, 3, 0, 0], [5, 0, 0, 0]], jnp.int32)
    slot_mapping = jnp.array([3 * ps + 3] + [5 * ps + i for i in range(15)], jnp.int32)
    cu_q_lens = jnp.array([0, 1, 16], jnp.int32)
    distribution = jnp.array([1, 2], jnp.int32)
    meta = (slot_mapping, kv_lens, page_table, cu_q_lens, distribution)
    want_out, want_pages = attention_step(q, k, v, pages, *meta, sm_scale=d**-0.5)
    replicas = tp // hkv if tp > hkv else 1
    spec = jax.sharding.PartitionSpec
    heads = jax.sharding.NamedSharding(mesh, spec(None, "model", None))
    page_split = jax.sharding.NamedSharding(mesh, spec(None, "model", None, None, None))
    kv_in = heads if replicas == 1 else jax.sharding.NamedSharding(mesh, spec())
    step = jax.jit(
        lambda *a: attention_step_sharded(*a, mesh=mesh, sm_scale=d**-0.5, backend="pallas")
    )
    out, new_pages = step(
        jax.device_put(q, heads),
        jax.device_put(k, kv_in),
        jax.device_put(v, kv_in),
        jax.device_put(jnp.repeat(pages, replicas, axis=1), page_split),  # heads stored r times
        *meta,
    )
    return {
        "out_max_err": float(jnp.max(jnp.abs(out - want_out))),
        "pages_equal": bool(jnp.array_equal(new_pages, jnp.repeat(want_pages, replicas, axis=1))),
        "out_spec": str(out.sharding.spec),
        "replicas": replicas,
        "seconds": round(time.perf_counter() - started, 1),
    }


def main() -> None:
    tp_model, kernel_model, qwen2 = sys.argv[1:4]
    result = {"devices": len(jax.devices()), "engines": {}, "kernel_steps": {}}
    engines = result["engines"]
    for tp in (1, 2, 4, 8):
        engines[f"reference tp{tp}"] = engine(tp_model, tp, "reference", max_tokens=6)
    # MQA with qkv bias and tied embeddings: the one kv head (and its bias) replicated 4 ways.
    for tp in (1, 4):
        engines[f"qwen2 tp{tp}"] = engine(qwen2, tp, "reference", max_tokens=6)
    # The weight matrices stacked by kind, each stack sharded as its rows were.
    engines["reference tp4 stacked"] = engine(
        tp_model, 4, "reference", max_tokens=6, stack_weights=True
    )
    # The kernel in the engine: one layer of 4 q / 2 kv heads split 2 ways, few steps (interpret
    # mode costs seconds per kernel call and device), its prefill tiles picked per call through
    # attention_tuning (the default schedule runs in the steps below).
    short = [PROMPTS[0]]
    engines["kernel-model reference tp1"] = engine(kernel_model, 1, "reference", 3, short)
    engines["kernel-model pallas tp2"] = engine(
        kernel_model, 2, "pallas", 3, short, attention_tuning="prefill_interleave=per_step"
    )
    # kv heads split (tp 2), stored twice (tp 4), and one kv head stored 8 times (tp 8).
    for tp, hq, hkv in ((2, 4, 2), (4, 8, 2), (8, 16, 1)):
        result["kernel_steps"][f"tp{tp}"] = sharded_kernel_step(tp, hq, hkv)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
