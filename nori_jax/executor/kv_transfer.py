"""Moving a request's KV pages from a prefill replica's pool to a decode replica's (one host).

Per move: a jitted gather of the request's pages from every layer's page array on the prefill
mesh, one `jax.device_put` of the gathered pages to the decode mesh's KV sharding (kv heads over
`model`, as on both pools), and a jitted scatter into the pages the decode allocator gave it
(the decode pool donated, updated in place). Page lists are padded to a bucket of page counts
(powers of two up to `max_pages_per_seq`) with the null page, which both sides may read and
write, so every program is compiled, and run once, at start-up: nothing compiles after warm-up.

Everything is enqueued without waiting: the gather runs after the prefill step that wrote the
pages and the scatter before the decode step that reads them, by the pools' data dependencies.
`is_done` says whether the moved pages have landed on the decode devices.

Across hosts the device_put becomes JAX's transfer API (`jax.experimental.transfer`: a transfer
server per process, the prefill side offering the gathered arrays, the decode side pulling them
into its sharding); docs/mesh.md sketches it. It is not built here: this machine has one host.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from nori_jax.core.step_plan import pick_bucket, token_buckets
from nori_jax.executor.compile_counter import CompileCounter
from nori_jax.executor.kv_cache import kv_sharding
from nori_jax.executor.mesh import replicated
from nori_jax.executor.runner import ModelRunner


def _gather(pages: list[jax.Array], ids: jax.Array) -> list[jax.Array]:
    return [p[ids] for p in pages]  # [B, KVH, 2, page_size, D] per layer


def _scatter(pages: list[jax.Array], ids: jax.Array, moved: list[jax.Array]) -> list[jax.Array]:
    return [p.at[ids].set(m) for p, m in zip(pages, moved, strict=True)]


def _abstract(arrays: list[jax.Array]) -> list[jax.ShapeDtypeStruct]:
    return [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding) for a in arrays]


class KVMover:
    def __init__(
        self, prefill: list[ModelRunner], decode: list[ModelRunner], max_pages_per_seq: int
    ):
        self.prefill, self.decode = list(prefill), list(decode)
        self.buckets = token_buckets(max_pages_per_seq, min_bucket=1)
        first = self.prefill[0].kv_pages[0]
        for r in self.prefill + self.decode:
            assert r.kv_pages[0].shape[1:] == first.shape[1:] and r.kv_pages[0].dtype == first.dtype
        self.bytes_per_page = sum(
            int(np.prod(p.shape[1:])) * jnp.dtype(p.dtype).itemsize
            for p in self.prefill[0].kv_pages
        )
        self._compiles = CompileCounter()
        # Shardings built once (a fresh NamedSharding per call misses jit's fast dispatch path).
        self._ids = [replicated(r.mesh) for r in self.prefill], [replicated(r.mesh) for r in decode]
        self._kv = (
            [kv_sharding(r.mesh) for r in self.prefill],
            [kv_sharding(r.mesh) for r in decode],
        )
        self._gathers: dict[tuple[int, int], jax.stages.Compiled] = {}
        self._scatters: dict[tuple[int, int], jax.stages.Compiled] = {}

    @property
    def num_recompiles(self) -> int:
        return self._compiles.count

    def compile_all(self) -> None:
        """A gather per prefill replica and a scatter per decode replica, per page bucket; then
        one move of null pages per (prefill, decode, bucket), so first runs happen here too."""
        for i, runner in enumerate(self.prefill):
            kv = _abstract(runner.kv_pages)
            gather = jax.jit(_gather, out_shardings=[self._kv[0][i]] * len(kv))
            for b in self.buckets:
                self._gathers[i, b] = gather.lower(kv, self._abstract_ids(0, i, b)).compile()
        for j, runner in enumerate(self.decode):
            kv = _abstract(runner.kv_pages)
            sharding = self._kv[1][j]
            scatter = jax.jit(_scatter, donate_argnums=(0,), out_shardings=[sharding] * len(kv))
            for b in self.buckets:
                moved = [
                    jax.ShapeDtypeStruct((b, *p.shape[1:]), p.dtype, sharding=sharding) for p in kv
                ]
                ids = self._abstract_ids(1, j, b)
                self._scatters[j, b] = scatter.lower(kv, ids, moved).compile()
        for src in range(len(self.prefill)):
            for dst in range(len(self.decode)):
                for b in self.buckets:
                    null = np.zeros(b, np.int32)
                    self.wait(self._move_padded(src, dst, null, null))

    def _abstract_ids(self, side: int, replica: int, bucket: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((bucket,), jnp.int32, sharding=self._ids[side][replica])

    def move(
        self, src: int, dst: int, src_pages: list[int], dst_pages: list[int]
    ) -> list[jax.Array]:
        """Enqueue the copy of prefill replica `src`'s pages into decode replica `dst`'s; the
        moved arrays are the handle (landed when they are ready)."""
        n = len(src_pages)
        if n != len(dst_pages) or n == 0:
            raise ValueError(
                f"{len(src_pages)} source pages for {len(dst_pages)} destination pages"
            )
        # JAX clips out-of-range indices silently, which would corrupt other requests' KV.
        for name, pages, runner in (
            ("src", src_pages, self.prefill[src]),
            ("dst", dst_pages, self.decode[dst]),
        ):
            if min(pages) < 1 or max(pages) >= runner.num_pages:
                raise ValueError(f"{name} page ids {pages} outside [1, {runner.num_pages})")
        b = pick_bucket(self.buckets, n)
        src_ids, dst_ids = np.zeros(b, np.int32), np.zeros(b, np.int32)
        src_ids[:n], dst_ids[:n] = src_pages, dst_pages
        return self._move_padded(src, dst, src_ids, dst_ids)

    def _move_padded(self, src: int, dst: int, src_ids: np.ndarray, dst_ids: np.ndarray):
        b = len(src_ids)
        p, d = self.prefill[src], self.decode[dst]
        with self._compiles.counting():
            gathered = self._gathers[src, b](p.kv_pages, jax.device_put(src_ids, self._ids[0][src]))
            moved = jax.device_put(gathered, self._kv[1][dst])
            d.kv_pages = self._scatters[dst, b](
                d.kv_pages, jax.device_put(dst_ids, self._ids[1][dst]), moved
            )
        return moved

    @staticmethod
    def is_done(handle: list[jax.Array]) -> bool:
        return all(a.is_ready() for a in handle)

    @staticmethod
    def wait(handle: list[jax.Array]) -> None:
        jax.block_until_ready(handle)
