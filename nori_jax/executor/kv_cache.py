"""The KV page pool: how many pages fit, and allocating them on the mesh (one array per layer).

Under tensor parallelism the pages' kv-head axis is split over `model`; a model with fewer kv
heads than devices stores each kv head tp / Hkv times (`stored_kv_heads`), one per device, so a
page costs every device the same 1/tp of its bytes either way.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nori_jax.executor import xla_flags
from nori_jax.model_config import ModelConfig
from pallas_kernels.kv_layout import KVLayout
from pallas_kernels.page_constants import stored_kv_heads

GIB = 1 << 30


def kv_sharding(mesh: Mesh) -> NamedSharding:
    """KV heads split over `model`, like the q/k/v projections that produce them."""
    spec = [None] * 5
    spec[KVLayout.KV_HEAD_AXIS] = "model"
    return NamedSharding(mesh, PartitionSpec(*spec))


def bytes_per_page(cfg: ModelConfig, page_size: int, dtype, tp: int = 1) -> int:
    """All layers' bytes for one page index across a `tp`-device mesh (replicated kv heads
    counted once per copy)."""
    heads = stored_kv_heads(cfg.num_kv_heads, tp)
    return cfg.num_layers * 2 * heads * page_size * cfg.head_dim * jnp.dtype(dtype).itemsize


def num_pages_for_memory(
    cfg: ModelConfig,
    page_size: int,
    dtype,
    mesh: Mesh,
    gpu_memory_utilization: float,
    cpu_kv_cache_gib: float,
    weight_bytes: int = 0,
) -> int:
    """Pages that fit in the memory budget left after the weights (already on the devices).

    On an accelerator: utilization x the allocator's limit, minus what is in use, per device (each
    device holds 1/tp of every page). The rest stays free for the step's activations. Under XLA's
    VMM allocator (xla_flags.py), which reports no statistics, the limit is the one the default
    allocator would have (the device's memory x JAX's memory fraction), and what is in use the
    weights' share of this device (`weight_bytes`: all devices together).
    """
    # This process's first device of the mesh (in a multi-host engine the others are remote).
    local = next(d for d in mesh.devices.flat if d.process_index == jax.process_index())
    stats = local.memory_stats()
    tp = mesh.shape["model"]
    if local.platform == "gpu" and xla_flags.uses_vmm_allocator():
        # The VMM allocator keeps no statistics (memory_stats() is None on the H200).
        limit = xla_flags.device_memory_limit(local.local_hardware_id)
        in_use = max((stats or {}).get("bytes_in_use", 0), weight_bytes // tp)
        budget = limit * gpu_memory_utilization - in_use
        per_page = bytes_per_page(cfg, page_size, dtype, tp) / tp
    elif stats and "bytes_limit" in stats:
        limit, in_use = stats["bytes_limit"], stats["bytes_in_use"]
        budget = limit * gpu_memory_utilization - in_use
        per_page = bytes_per_page(cfg, page_size, dtype, tp) / tp
    else:
        budget = cpu_kv_cache_gib * GIB
        per_page = bytes_per_page(cfg, page_size, dtype, tp)
    return int(budget // per_page)


def allocate_kv_pages(
    cfg: ModelConfig, num_pages: int, page_size: int, dtype, mesh: Mesh
) -> list[jax.Array]:
    heads = stored_kv_heads(cfg.num_kv_heads, mesh.shape["model"])
    layout = KVLayout(num_pages, heads, page_size, cfg.head_dim)
    sharding = kv_sharding(mesh)
    zeros = jax.jit(lambda: jnp.zeros(layout.shape, dtype), out_shardings=sharding)
    return [zeros() for _ in range(cfg.num_layers)]


def finite_program(pages) -> jax.stages.Compiled:
    """The program that sets every NaN and inf of the KV pages to 0, in place (donated; an
    elementwise program, so XLA writes its output into its input and the pool neither moves nor
    needs a second copy), compiled ahead for `pages` (arrays or their abstract values), so that
    nothing compiles when it first runs (runner.replace_weights).

    Why: a masked position of a page (past a sequence's end, in a page's tail another request
    wrote) weighs exactly 0 in the attention, which cancels any finite value there, but 0 x NaN
    is NaN: weights that wrote NaN or inf into the pool (a trainer's diverged step) would spoil
    requests long after they were replaced."""

    def finite(pages):
        # (tested in float32: an fp8 page's values convert exactly, and no backend is asked
        # for an is-finite of fp8 itself)
        return [
            jnp.where(jnp.isfinite(p.astype(jnp.float32)), p, jnp.zeros((), p.dtype)) for p in pages
        ]

    sharding = pages[0].sharding
    return jax.jit(finite, donate_argnums=0, out_shardings=sharding).lower(pages).compile()
