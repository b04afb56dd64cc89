"""The device side: one jitted ragged step, compiled ahead of time for every token bucket.

    step(state, kv_pages, prev_tokens, batch)
        -> (next_tokens int32[S], logprobs float32[S], kv_pages)

`state` is the model's parameters (nnx.split once; the graphdef is closed over), `kv_pages` is
donated and comes back updated in place, and only S tokens + S logprobs return to the host.
`prev_tokens` is the previous step's `next_tokens`, still on the device: decode rows whose input
is the previous step's sample read it from there (`batch["prev_index"]`), which lets the host plan
step N+1 while step N runs.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from nori_jax import compile_counter
from nori_jax.kv_cache import allocate_kv_pages, kv_sharding
from nori_jax.mesh import replicated
from nori_jax.models.llama import AttentionInputs
from nori_jax.sampler import sample
from nori_jax.step_plan import StepPlan
from nori_jax.weights.loader import LoadedModel

logger = logging.getLogger(__name__)


def _step(graphdef, state, kv_pages, prev_tokens, batch):
    model = nnx.merge(graphdef, state)
    prev = batch["prev_index"]
    input_ids = jnp.where(prev >= 0, prev_tokens[jnp.maximum(prev, 0)], batch["input_ids"])
    meta = AttentionInputs(
        slot_mapping=batch["slot_mapping"],
        kv_lens=batch["kv_lens"],
        page_table=batch["page_table"],
        cu_q_lens=batch["cu_q_lens"],
        distribution=batch["distribution"],
    )
    hidden, kv_pages = model(input_ids, batch["positions"], kv_pages, meta)
    logits = model.compute_logits(hidden[batch["logits_indices"]])  # [S, V]
    tokens, logprobs = sample(
        logits,
        batch["temperature"],
        batch["top_p"],
        batch["top_k"],
        batch["seeds"],
        batch["sample_index"],
    )
    return tokens, logprobs, kv_pages


class ModelRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        mesh: Mesh,
        num_pages: int,
        page_size: int,
        max_num_seqs: int,
        max_pages_per_seq: int,
        buckets: list[int],
    ):
        self.model = loaded
        self.mesh = mesh
        self.num_pages, self.page_size = num_pages, page_size
        self.max_num_seqs, self.max_pages_per_seq = max_num_seqs, max_pages_per_seq
        self.buckets = list(buckets)
        cfg = loaded.config
        self.kv_pages = allocate_kv_pages(cfg, num_pages, page_size, loaded.dtype, mesh)
        # Sharding objects built once: a fresh one per call misses jit's fast dispatch path.
        self._replicated = replicated(mesh)
        self._kv_sharding = kv_sharding(mesh)
        self._jitted = jax.jit(
            functools.partial(_step, loaded.graphdef),
            donate_argnums=(1,),
            out_shardings=(
                self._replicated,
                self._replicated,
                [self._kv_sharding] * cfg.num_layers,
            ),
        )
        self._executables: dict[int, jax.stages.Compiled] = {}
        self.compile_seconds = 0.0
        self._prev_tokens = jax.device_put(np.zeros(max_num_seqs, np.int32), self._replicated)

    def _abstract_batch(self, t: int) -> dict[str, jax.ShapeDtypeStruct]:
        s, mp, rep = self.max_num_seqs, self.max_pages_per_seq, self._replicated
        i32, f32 = jnp.int32, jnp.float32
        shapes = {
            "input_ids": ((t,), i32),
            "positions": ((t,), i32),
            "slot_mapping": ((t,), i32),
            "cu_q_lens": ((s + 1,), i32),
            "kv_lens": ((s,), i32),
            "page_table": ((s, mp), i32),
            "distribution": ((2,), i32),
            "logits_indices": ((s,), i32),
            "temperature": ((s,), f32),
            "top_p": ((s,), f32),
            "top_k": ((s,), i32),
            "seeds": ((s,), i32),
            "sample_index": ((s,), i32),
            "prev_index": ((t,), i32),
        }
        return {
            k: jax.ShapeDtypeStruct(shape, dt, sharding=rep) for k, (shape, dt) in shapes.items()
        }

    def compile_all(self) -> None:
        """Lower every bucket, then compile them in parallel (XLA releases the GIL)."""
        start = time.perf_counter()
        as_abstract = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        state_abs = jax.tree.map(as_abstract, self.model.state)
        kv_abs = [as_abstract(x) for x in self.kv_pages]
        prev_abs = jax.ShapeDtypeStruct((self.max_num_seqs,), jnp.int32, sharding=self._replicated)
        logger.info("compiling %d token buckets %s", len(self.buckets), self.buckets)
        lowered = {
            t: self._jitted.lower(state_abs, kv_abs, prev_abs, self._abstract_batch(t))
            for t in self.buckets
        }

        def compile_one(t: int) -> jax.stages.Compiled:
            t0 = time.perf_counter()
            executable = lowered[t].compile()
            logger.info("bucket %d compiled in %.1fs", t, time.perf_counter() - t0)
            return executable

        with concurrent.futures.ThreadPoolExecutor(
            max_workers=min(16, os.cpu_count() or 4)
        ) as pool:
            compiled = dict(zip(lowered, pool.map(compile_one, lowered), strict=True))
        self._executables.update(compiled)
        self.compile_seconds = time.perf_counter() - start
        logger.info(
            "compiled %d buckets %s in %.1fs", len(compiled), self.buckets, self.compile_seconds
        )

    def warm_up(self) -> None:
        """Run every compiled bucket once on a plan that touches only the null page.

        First executions may still build programs (interpret-mode kernels on CPU trace their
        bodies on first use; some backends load or autotune lazily); doing it here keeps the
        serving loop at zero compiles. Each plan has a decode row and a prefill row, so both
        kernel paths run; every slot maps into page 0, whose contents are garbage by design.
        """
        s, mp = self.max_num_seqs, self.max_pages_per_seq
        for t in self.buckets:
            t0 = time.perf_counter()
            q_lens = [1, t - 1] if t > 1 and s > 1 else [1]
            q_lens[-1] = min(q_lens[-1], mp * self.page_size)
            n = sum(q_lens)
            cu = np.zeros(s + 1, np.int32)
            cu[1 : len(q_lens) + 1] = np.cumsum(q_lens)
            cu[len(q_lens) + 1 :] = n
            kv_lens = np.zeros(s, np.int32)
            kv_lens[: len(q_lens)] = q_lens
            positions = np.zeros(t, np.int32)
            positions[1:n] = np.arange(n - 1)
            plan = StepPlan(
                input_ids=np.ones(t, np.int32),
                positions=positions,
                slot_mapping=positions % self.page_size,
                cu_q_lens=cu,
                kv_lens=kv_lens,
                page_table=np.zeros((s, mp), np.int32),
                distribution=np.asarray([1, len(q_lens)], np.int32),
                logits_indices=np.maximum(cu[1:] - 1, 0),
                temperature=np.ones(s, np.float32),
                top_p=np.full(s, 0.9, np.float32),
                top_k=np.full(s, 5, np.int32),
                seeds=np.zeros(s, np.int32),
                sample_index=np.zeros(s, np.int32),
                prev_index=np.full(t, -1, np.int32),
                request_ids=[],
                num_scheduled_tokens=[],
                samples=[],
                num_tokens=n,
            )
            self.step(plan)
            logger.info("bucket %d warmed up in %.1fs", t, time.perf_counter() - t0)

    def launch(self, plan: StepPlan) -> tuple[jax.Array, jax.Array]:
        """Enqueue the step and return its (tokens, logprobs) device arrays without waiting.

        The device runs launched steps in order, so a step may read pages or tokens that the
        previous one is still writing.
        """
        executable = self._executables.get(plan.bucket)
        if executable is None:
            raise RuntimeError(f"bucket {plan.bucket} was not compiled (buckets: {self.buckets})")
        # The plan's numpy arrays go straight into the call: the executable's C++ dispatch path
        # transfers them to their (replicated) shardings for a fraction of what jax.device_put
        # of the same dict costs in Python (docs/benchmarks.md, "host launch cost").
        tokens, logprobs, self.kv_pages = executable(
            self.model.state, self.kv_pages, self._prev_tokens, plan.device_arrays()
        )
        self._prev_tokens = tokens
        # Start the device-to-host copy now, so fetching later does not add a round trip.
        tokens.copy_to_host_async()
        logprobs.copy_to_host_async()
        return tokens, logprobs

    @staticmethod
    def fetch(handle: tuple[jax.Array, jax.Array]) -> tuple[np.ndarray, np.ndarray]:
        """Wait for a launched step's samples."""
        return np.asarray(handle[0]), np.asarray(handle[1])

    def step(self, plan: StepPlan) -> tuple[np.ndarray, np.ndarray]:
        """Launch and wait: the synchronous step."""
        return self.fetch(self.launch(plan))


compile_counter.install()
