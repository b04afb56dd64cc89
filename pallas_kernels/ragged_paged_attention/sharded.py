"""The attention step split over kv heads on a mesh axis (tensor parallelism), with `shard_map`.

Each device of the axis runs `attention_step` (the KV write, then the kernel or the reference) on
its own heads and its own slice of the pages; the step's metadata is replicated. Nothing crosses
devices: the only collective of an attention block is the all-reduce after o_proj, in the model.

Heads per device, for tp devices, Hq query heads and Hkv kv heads (tp divides Hq):

    tp divides Hkv     device i holds kv heads [i Hkv/tp, (i+1) Hkv/tp) and their q heads;
                       k, v and the pages arrive split over heads.
    Hkv divides tp     (fewer kv heads than devices) the pages hold tp kv heads, one per device,
                       each kv head stored r = tp/Hkv times (vLLM's and tpu-inference's
                       replication): device i holds kv head i // r, which its Hq/tp q heads use.
                       k and v arrive replicated [T, Hkv, D] (k_proj and v_proj are replicated)
                       and each device keeps its head.

q heads are split in contiguous blocks, so device i's q heads [i Hq/tp, (i+1) Hq/tp) use kv
heads (i Hq/tp) // G onwards (G = Hq/Hkv): exactly the kv heads the device holds in both cases.

The Pallas kernel in Mosaic GPU interpret mode (CPU, the tests) cannot run on several devices at
once: JAX 0.11.2's interpreter keeps one simulated GPU state per process, which a kernel resets
and checks as it ends, whichever device it runs for (concurrent devices fail its "Barrier remains
allocated" check). There each device hands its local shard to a host callback that runs the
kernel as a one-device program, one device at a time. On a GPU the kernel is compiled inside the
shard_map as it is.
"""

from __future__ import annotations

import functools
import threading

import jax
import numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from pallas_kernels.kv_layout import KVLayout, write_kv_step
from pallas_kernels.page_constants import stored_kv_heads
from pallas_kernels.ragged_paged_attention.api import attention_step
from pallas_kernels.ragged_paged_attention.pallas_attention import ragged_paged_attention_pallas
from pallas_kernels.ragged_paged_attention.tuning_overrides import TuningOverrides

# One interpreted kernel at a time in this process (see the module docstring).
_INTERPRETER_LOCK = threading.Lock()


def attention_step_sharded(
    q: jax.Array,  # [T, Hq, D]   split over heads
    k: jax.Array,  # [T, Hkv, D]  split over heads, or replicated when kv heads are replicated
    v: jax.Array,  # [T, Hkv, D]
    kv_pages: jax.Array,  # [P, stored_kv_heads(Hkv, tp), 2, PS, D]  split over kv heads
    slot_mapping: jax.Array,  # int32[T]
    kv_lens: jax.Array,  # int32[S]
    page_table: jax.Array,  # int32[S, MP]
    cu_q_lens: jax.Array,  # int32[S + 1]
    distribution: jax.Array,  # int32[2]
    *,
    mesh: Mesh,
    axis: str = "model",
    sm_scale: float,
    soft_cap: float | None = None,
    kv_scales: jax.Array | None = None,
    backend: str = "reference",
    tuning_overrides: TuningOverrides = (),
) -> tuple[jax.Array, jax.Array]:
    """attention_step over `mesh`'s axis `axis`: (out [T, Hq, D] split over heads, kv_pages)."""
    tp = mesh.shape[axis]
    hq, hkv, hkv_stored = q.shape[1], k.shape[1], kv_pages.shape[KVLayout.KV_HEAD_AXIS]
    if hq % tp:
        raise ValueError(f"num_q_heads={hq} must be a multiple of the {axis} axis size {tp}")
    if hkv_stored != stored_kv_heads(hkv, tp):
        raise ValueError(
            f"{kv_pages.shape=}: pages must hold {stored_kv_heads(hkv, tp)} kv heads for "
            f"num_kv_heads={hkv} over {tp} devices"
        )
    replicas = hkv_stored // hkv  # copies of each kv head in the pages (1: none)
    heads = PartitionSpec(None, axis, None)
    page_spec = [None] * 5
    page_spec[KVLayout.KV_HEAD_AXIS] = axis
    pages = PartitionSpec(*page_spec)
    kv_in = heads if replicas == 1 else PartitionSpec()
    meta = PartitionSpec()

    def local(q, k, v, kv_pages, slot_mapping, kv_lens, page_table, cu_q_lens, distribution, sc):
        if replicas > 1:  # keep the one kv head this device's q heads use
            head = lax.axis_index(axis) // replicas
            k = lax.dynamic_slice_in_dim(k, head, 1, axis=1)
            v = lax.dynamic_slice_in_dim(v, head, 1, axis=1)
        if backend == "pallas" and jax.default_backend() == "cpu":
            kv_pages = write_kv_step(kv_pages, k, v, slot_mapping, sc)
            meta = (kv_lens, page_table, cu_q_lens, distribution)
            statics = dict(sm_scale=sm_scale, soft_cap=soft_cap, tuning_overrides=tuning_overrides)
            out = _interpreted_kernel(q, kv_pages, *meta, kv_scales=sc, **statics)
            return out, kv_pages
        return attention_step(
            q,
            k,
            v,
            kv_pages,
            slot_mapping,
            kv_lens,
            page_table,
            cu_q_lens,
            distribution,
            sm_scale=sm_scale,
            soft_cap=soft_cap,
            kv_scales=sc,
            backend=backend,
            tuning_overrides=tuning_overrides,
        )

    sharded = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(heads, kv_in, kv_in, pages, meta, meta, meta, meta, meta, meta),
        out_specs=(heads, pages),
        # The Pallas call has no replication rule; every output here is split over `axis`.
        check_vma=False,
    )
    return sharded(
        q, k, v, kv_pages, slot_mapping, kv_lens, page_table, cu_q_lens, distribution, kv_scales
    )


def _interpreted_kernel(q, kv_pages, *meta, kv_scales, **statics):
    """The interpret-mode kernel on this device's shard, run on the host as a one-device
    program (one device at a time): out [T, Hq_local, D]. `meta`: kv_lens, page_table,
    cu_q_lens, distribution; `statics`: the kernel's static keyword arguments."""
    scales = () if kv_scales is None else (kv_scales,)
    run = functools.partial(_run_interpreted, **statics)
    out_shape = jax.ShapeDtypeStruct(q.shape, q.dtype)
    return jax.pure_callback(run, out_shape, q, kv_pages, *meta, *scales)


def _run_interpreted(q, kv_pages, *meta_and_scales, **statics):
    meta, scales = meta_and_scales[:4], meta_and_scales[4:]
    with _INTERPRETER_LOCK:
        out = ragged_paged_attention_pallas(
            q,
            kv_pages,
            *meta,
            kv_scales=scales[0] if scales else None,
            interpret=True,
            **statics,
        )
        return np.asarray(out)
