"""Building a disaggregated engine: prefill and decode replicas on their own sub-meshes, and the
KV mover between their pools (`MeshConfig(prefill=P, decode=D)`, presets `pd-1-1`, `pd-2-2`).

Each replica is a whole engine (model, KV pool, compiled buckets) on its `model` devices
(mesh_config.py says which), built with the same settings, so its pool, page size and buckets
match the others'. The cores are driven by `DisaggregatedCore` (core/disaggregated_core.py),
which the frontends run like any engine core.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from nori_jax.core.disaggregated_core import DisaggregatedCore
from nori_jax.engine import EngineParts, build_engine
from nori_jax.engine_config import EngineConfig
from nori_jax.executor.kv_transfer import KVMover

logger = logging.getLogger(__name__)


def build_disaggregated(config: EngineConfig) -> EngineParts:
    """Every replica, the mover compiled and warmed, and the core over them. The parts' model
    and runner are the first decode replica's (what a frontend reads: tokenizer, dtype)."""
    started = time.perf_counter()
    mesh_config = config.mesh
    assert mesh_config.disaggregated
    parts: dict[str, list[EngineParts]] = {"prefill": [], "decode": []}
    tokenizer = None  # loaded once, shared by the replicas
    for i, role in enumerate(mesh_config.roles()):
        logger.info("building %s replica %d of %s", role, i, mesh_config.describe())
        built = build_engine(config, i, tokenizer=tokenizer, role=role)
        tokenizer = built.tokenizer
        parts[role].append(built)
    prefill, decode = parts["prefill"], parts["decode"]
    first = decode[0]
    # 8-bit pages are stored scaled: a page moved between pools of different scales would decode
    # to other values. The same weights and calibration tokens give the same scales; check it.
    scales = [p.runner.kv_scales for p in prefill + decode]
    if scales[0] is not None and not all(np.array_equal(s, scales[0]) for s in scales):
        raise RuntimeError("the replicas calibrated different KV scales; pages cannot move")
    mover = KVMover(
        [p.runner for p in prefill],
        [p.runner for p in decode],
        first.scheduler_config.max_pages_per_seq,
    )
    t0 = time.perf_counter()
    mover.compile_all()
    logger.info(
        "KV mover: %d page buckets %s for %d prefill x %d decode replicas, compiled and warmed in "
        "%.1fs (%d bytes per page)",
        len(mover.buckets),
        mover.buckets,
        len(prefill),
        len(decode),
        time.perf_counter() - t0,
        mover.bytes_per_page,
    )
    core = DisaggregatedCore([p.core for p in prefill], [p.core for p in decode], mover)
    logger.info(
        "disaggregated engine ready in %.1fs: %s",
        time.perf_counter() - started,
        mesh_config.describe(),
    )
    load_seconds = sum(p.load_seconds for p in prefill + decode)
    return EngineParts(
        config,
        core,
        first.model,
        first.runner,
        first.scheduler_config,
        first.max_model_len,
        load_seconds,
        first.gpu_client,
    )
