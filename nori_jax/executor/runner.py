"""The device side: the step's programs (step_programs.py), compiled ahead of time per token
bucket, sampler program and multi-step key, and launched on buffers the runner owns.

**Buffers that never move.** XLA runs each program as a CUDA graph, and a launch after any of the
graph's buffers moved updates and re-uploads the graph first: on the H200 a chain of 400 kernels
launched in 1.9 ms whenever one input or output was a fresh array, against 0.8 ms with none
(benchmarks/engine/graph_launch_bench.py; docs/benchmarks.md). So every buffer of the forward pass
keeps its address from launch to launch: `params` never change (the norm scales stacked into a few
arrays once, and with `stack_weights` the weight matrices, param_packing.py), and the runner owns
one device buffer each for the KV pages, `samples`, `logits`, the step buffer and (with multi-step
decode) `all_samples`, which each program takes donated and returns in place. A step's fresh
host-to-device buffer goes through `stage` (a one-kernel program, cheap to update), and the host
reads the samples through a copy (the runner's own buffer is donated to the next launch before the
host reads it). That copy is made by the next launch's staging program ("stage+peek"): in an
overlapped engine the next step is launched before the host fetches this one, and one program per
launch fewer saves a launch's worth of host time. A fetch that finds no later launch makes the copy
itself (`peek`). The parameters go in as a flat list prepared once; a launch hands its flat
argument list straight to each program's executable (direct_call.py), past JAX's per-argument
dispatch checks.

The random and filtering samplers are programs of their own, so their variants
(sampling_modes.py) cost a handful of small compiles rather than more forward passes per bucket,
and the step never branches on device data. Multi-step decode (`num_scheduler_steps` K > 1) adds
one program per (small bucket, sampler program) that runs both K times in a scan.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import os
import time
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nori_jax.core.sampling_modes import (
    GREEDY,
    SamplerProgram,
    filter_buckets,
    multi_step_programs,
    sampler_programs,
)
from nori_jax.core.step_layout import TOKEN_FIELDS, TOP_LOGPROBS, StepLayout
from nori_jax.core.step_plan import StepPlan
from nori_jax.executor import program_options
from nori_jax.executor.direct_call import DirectCall
from nori_jax.executor.kv_cache import allocate_kv_pages, finite_program, kv_sharding
from nori_jax.executor.mesh import replicated
from nori_jax.executor.param_packing import PackedParams
from nori_jax.executor.placement import ReplicatedPut, put
from nori_jax.executor.step_programs import (
    count_sampled,
    forward,
    logit_rows,
    multi_step,
    peek,
    penalize,
    prompt_logprobs_from_logits,
    sample_from_logits,
    stage,
    stage_and_peek,
    top_logprobs_from_logits,
)
from nori_jax.models.linear import MODEL
from nori_jax.weights.loader import LoadedModel, PreparedTensor
from nori_jax.weights.residency import offload_weights, restore_weights
from nori_jax.weights.update import replace_weights

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class LaunchTimes:
    """Cumulative host time inside `launch`, by part (seconds): where a launch waits, if it does."""

    # the step buffer's host-to-device transfer and its staging program (which copies the last
    # launch's samples and starts their copy back)
    transfer: float = 0.0
    forward: float = 0.0  # dispatch of the forward pass (or multi-step program)
    sampler: float = 0.0  # a sampler program (not greedy steps)


class LaunchedSamples:
    """A launched step's samples: `array` is the host's copy (int32[2, S], or [K, 2, S] from a
    multi-step launch), None until the next launch or `fetch` makes it from the runner's buffer
    (`source`: None for `samples`, "multi-step" for `all_samples`); `top` and `prompt`, in a
    step with top-logprob or prompt-logprob rows, their output (fresh, already on its way to the
    host) and row count."""

    __slots__ = ("array", "source", "top", "prompt")

    def __init__(self, source: str | None = None):
        self.array: jax.Array | None = None
        self.source = source
        self.top: tuple[jax.Array, int] | None = None  # (output, rows)
        self.prompt: tuple[jax.Array, int, int] | None = None  # (output, rows, top)


def _program_name(kind: str, key) -> str:
    """ "bucket 128", "sampler random (64 rows)", "multi-step bucket 16 greedy", "stage",
    "stage+peek", "peek", "peek multi-step": a program's name in the start-up log and for inspection
    (compiled_programs)."""
    if kind == "sampler":
        return f"sampler {key[0].name} ({key[1]} rows)"
    if kind == "top":
        return f"top logprobs ({key} rows)"
    if kind == "penalize":
        return f"penalties ({key} rows)"
    if kind == "count":
        return "penalty counts"
    if kind == "prompt":
        return f"prompt logprobs top {key[0]} ({key[1]} rows)"
    if kind == "multi":
        return f"multi-step bucket {key[0]} {key[1].name}"
    if kind in ("stage", "stage+peek", "peek"):
        return kind if key is None else f"{kind} {key}"
    return f"bucket {key}"


def _flat_variables(state, leaves: list) -> list:
    """The state's (path, variable) pairs, checked to be in the order of `leaves` (the state's
    leaves as the runner packs them), so that leaf i's variable is the i-th."""
    flat = list(nnx.to_flat_state(state))
    if len(flat) != len(leaves) or any(
        v.get_value() is not x for (_, v), x in zip(flat, leaves, strict=True)
    ):
        raise RuntimeError("the model state's variables are not in the order of its leaves")
    return flat


class ModelRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        mesh: Mesh,
        num_pages: int,
        page_size: int,
        layout: StepLayout,
        buckets: list[int],
        kv_dtype=None,
        kv_scales: np.ndarray | None = None,
        num_scheduler_steps: int = 1,
        multi_step_max_seqs: int = 0,
        stack_weights: bool = False,
    ):
        """`kv_dtype`: the KV pages' dtype (None: the model's; an fp8 dtype for 8-bit pages).
        `kv_scales`: float32[num_layers, 2] of fp8 pages (kv_calibration.py); None: 1.0.
        `num_scheduler_steps` > 1: multi-step programs for the buckets and sampler programs a
        launch of at most `multi_step_max_seqs` decode rows can need. `stack_weights`: the weight
        matrices stacked by kind too (param_packing.py); the model's state then holds the
        stacked leaves' shapes only (`flat_weights` gives them as arrays)."""
        self.model = loaded
        self.mesh = mesh
        self.num_pages, self.page_size = num_pages, page_size
        self.layout = layout
        self.buckets = list(buckets)
        cfg = loaded.config
        self.kv_dtype = loaded.dtype if kv_dtype is None else kv_dtype
        self.kv_pages = allocate_kv_pages(cfg, num_pages, page_size, self.kv_dtype, mesh)
        self.kv_scales = kv_scales
        leaves, treedef = jax.tree.flatten(loaded.state)
        # Small vectors (the norm scales) stacked, and the matrices with `stack_weights`: fewer
        # arguments per launch (param_packing.py).
        self._packed = PackedParams(leaves, treedef, stack_matrices=stack_weights)
        self.stack_weights = stack_weights
        self._asleep = False
        self._pack_state()
        # Sharding objects built once: a fresh one per call misses jit's fast dispatch path.
        self._replicated = replicated(mesh)
        self._kv_sharding = kv_sharding(mesh)
        logits_shardings = (NamedSharding(mesh, PartitionSpec(None, MODEL)), self._replicated)
        # One program per bucket (`bucket`, static, says how many token slots of the step
        # buffer it reads); the buffer's shape is the same for all.
        self._forward_fn = jax.jit(
            functools.partial(
                forward, loaded.graphdef, self._packed, layout, kv_scales, logits_shardings
            ),
            static_argnums=(0,),
            # pages, samples and logits: their buffers come back as the outputs (kept even
            # where unused, so that they do)
            donate_argnums=(2, 3, 4),
            keep_unused=True,
            out_shardings=(
                self._replicated,
                self._replicated,
                [self._kv_sharding] * cfg.num_layers,
            ),
        )
        # The sampler programs, per (program, logit rows R) a step of some bucket can need: the
        # forward pass samples greedily itself, so greedy runs again only on penalized logits.
        self.sampler_keys = sorted(
            {
                (program, r)
                for r in {logit_rows(layout.max_num_seqs, t) for t in self.buckets}
                for program in sampler_programs(layout.max_num_seqs, r)
            }
        )
        self._sample_fns = {
            program: jax.jit(
                functools.partial(sample_from_logits, layout, program),
                static_argnums=(0,),
                donate_argnums=(1,),
                keep_unused=True,
                out_shardings=self._replicated,
            )
            for program in {p for p, _ in self.sampler_keys}
        }
        # The programs of a step's listed rows (penalties, top and prompt logprobs): one per
        # bucket of them, the sampler's filter buckets.
        self.row_buckets = filter_buckets(layout.max_num_seqs)
        # The top logprobs of a step whose plan lists rows for them.
        self._top_fn = jax.jit(
            functools.partial(top_logprobs_from_logits, layout),
            static_argnums=(0,),
            out_shardings=self._replicated,
        )
        # Penalties (executor/penalties.py): before the sampler, and its tokens counted after.
        self._penalize_fn = jax.jit(
            functools.partial(penalize, layout),
            static_argnums=(0,),
            donate_argnums=(1, 2, 3),
            out_shardings=(self._replicated,) * 3,
        )
        self._count_fn = jax.jit(
            functools.partial(count_sampled, layout),
            donate_argnums=(0,),
            out_shardings=self._replicated,
        )
        # Prompt logprobs, per (how many top tokens, bucket of rows): after the forward pass.
        self.prompt_keys = [(top, b) for top in (0, 1, TOP_LOGPROBS) for b in self.row_buckets]
        self._prompt_fn = jax.jit(
            functools.partial(prompt_logprobs_from_logits, layout),
            static_argnums=(0, 1),
            out_shardings=self._replicated,
        )
        self._stage_fn = jax.jit(stage, donate_argnums=(0,), out_shardings=self._replicated)
        self._peek_fn = jax.jit(peek, out_shardings=self._replicated)
        self._stage_peek_fn = jax.jit(
            stage_and_peek, donate_argnums=(0,), out_shardings=self._replicated
        )
        self.num_scheduler_steps = num_scheduler_steps
        self.multi_step_keys = (
            multi_step_programs(self.buckets, layout.max_num_seqs, multi_step_max_seqs)
            if num_scheduler_steps > 1
            else []
        )
        self._multi_fns = {
            program: jax.jit(
                functools.partial(
                    multi_step,
                    loaded.graphdef,
                    self._packed,
                    layout,
                    kv_scales,
                    logits_shardings,
                    page_size,
                    num_scheduler_steps,
                    program,
                ),
                static_argnums=(0,),
                donate_argnums=(2, 3, 4),
                keep_unused=True,
                out_shardings=(
                    self._replicated,
                    self._replicated,
                    [self._kv_sharding] * cfg.num_layers,
                ),
            )
            for program in {p for _, p in self.multi_step_keys}
        }
        self._forwards: dict[int, jax.stages.Compiled] = {}
        self._samplers: dict[tuple[SamplerProgram, int], jax.stages.Compiled] = {}
        self._multis: dict[tuple[int, SamplerProgram], jax.stages.Compiled] = {}
        # Every program as the launch calls it (direct_call.py), by its compile key:
        # ("forward", bucket), ("sampler", (program, R)), ("multi", (bucket, program)),
        # ("stage", None), ("stage+peek", source) or ("peek", source) (source: None for the
        # samples, "multi-step" for a multi-step launch's).
        self._direct: dict[tuple[str, object], DirectCall] = {}
        self.compile_seconds = 0.0
        self.compiler_options: dict = {}  # compile_all: program_options.for_weights
        # Each program's own options by `_program_name` (a forward pass's may differ by bucket)
        self.compiler_options_of: dict[str, dict] = {}
        self.launch_times = LaunchTimes()
        self._put_step = ReplicatedPut((layout.size,), np.int32, self._replicated)
        # Start each step's device-to-host copy as soon as the next launch has made the host's
        # copy of its samples (fetch then finds them on the host), or let fetch copy them.
        self.copy_back_early = True
        self._allocate_buffers()

    def _allocate_buffers(self) -> None:
        """The device buffers every step reads and writes in place (module docstring: their
        addresses never change, so XLA's CUDA graphs launch without an update), fresh."""
        s, vocab = self.layout.max_num_seqs, self.model.config.vocab_size
        self._step_state = put(self.layout.new_step(), self._replicated)
        self._samples_state = put(np.zeros((2, s), np.int32), self._replicated)
        self._logits_state = put(np.zeros((s, vocab), np.float32), self._replicated)
        # Per slot: each token's count among its request's outputs, and whether its prompt holds
        # it (1,024 x 49,152 x 5 bytes = 250 MB for SmolLM2; outside the KV pool's budget, like
        # the logits, in what gpu_memory_utilization leaves free).
        self._penalty_counts = put(np.zeros((s, vocab), np.int32), self._replicated)
        self._penalty_in_prompt = put(np.zeros((s, vocab), bool), self._replicated)
        k = self.num_scheduler_steps
        self._all_samples_state = (
            put(np.zeros((k, 2, s), np.int32), self._replicated) if self.multi_step_keys else None
        )
        # The last launch's samples while only the runner's buffer holds them (no copy yet).
        self._unpeeked: LaunchedSamples | None = None

    def _pack_state(self) -> None:
        """The launch's parameter arguments from the model's state. With `stack_weights` the
        stacks replace the stacked leaves: each is deleted as its stack is built, and the state
        keeps its shape, dtype and sharding (a `jax.ShapeDtypeStruct`, as a weight dropped by
        `sleep` does), so the device never holds two copies of the weights."""
        leaves = jax.tree.leaves(self.model.state)  # the order PackedParams was built in
        self._params = self._packed.pack(leaves, consume=self.stack_weights)
        if self.stack_weights:
            flat = _flat_variables(self.model.state, leaves)
            for i in self._packed.stacked_leaves:
                x = leaves[i]
                flat[i][1].set_value(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding))

    def _unpack_state(self) -> None:
        """The stacked leaves back into the model's state as arrays (the stacks freed one by one),
        before an operation on the state's arrays (sleep, new weights); `_pack_state` after it."""
        params, self._params = self._params, []
        if not self.stack_weights or not params:
            return
        flat = _flat_variables(self.model.state, jax.tree.leaves(self.model.state))
        leaves = self._packed.unpack(params, consume=True)
        for i in self._packed.stacked_leaves:
            flat[i][1].set_value(leaves[i])

    def flat_weights(self) -> Iterator[tuple[tuple, jax.Array]]:
        """(path, array) of every parameter in the state's order, one at a time: the state's
        own arrays, or with `stack_weights` a copy of each stacked leaf's row made as it is
        yielded (so reading them all holds the weights plus one leaf: for inspection and export,
        not for a step loop)."""
        stacked = set(self._packed.stacked_leaves) if self.stack_weights and self._params else ()
        state = self.model.state
        for i, (path, var) in enumerate(_flat_variables(state, jax.tree.leaves(state))):
            yield path, self._packed.leaf(self._params, i) if i in stacked else var.get_value()

    def sleep(self, keep_weights: bool) -> None:
        """Give the device back (a trainer on the same GPU, between rollouts): the KV pages and
        the step's buffers are released, and the weights go to pinned host memory
        (`keep_weights`) or away. The compiled programs stay. The caller makes sure nothing is in
        flight and that no one reads the prefix cache's pages afterwards."""
        self._unpack_state()
        self._asleep = True
        self.kv_pages = []
        self._step_state = self._samples_state = self._logits_state = None
        self._penalty_counts = self._penalty_in_prompt = self._all_samples_state = None
        self._unpeeked = None
        offload_weights(self.model, keep_weights)

    def wake_up(self) -> None:
        """Back on the device after `sleep`: the weights (from host memory, or as
        `replace_weights` placed them while asleep), fresh KV pages and step buffers."""
        restore_weights(self.model)
        self._asleep = False
        self._pack_state()
        cfg = self.model.config
        self.kv_pages = allocate_kv_pages(
            cfg, self.num_pages, self.page_size, self.kv_dtype, self.mesh
        )
        self._allocate_buffers()
        # Allocated when this returns (the trainer's memory is taken back now, not at the first
        # step), and its time is the wake-up's own.
        jax.block_until_ready((self.kv_pages, self._step_state, self._logits_state))

    def _samples_buffer(self, source: str | None) -> jax.Array:
        """The runner's buffer a LaunchedSamples of `source` is copied from."""
        return self._samples_state if source is None else self._all_samples_state

    def _abstract(self, shape, dtype) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=self._replicated)

    def compile_all(self, on_compiled: Callable[[str, float], None] | None = None) -> None:
        """Lower every bucket, sampler and multi-step program on this thread and compile each on
        a pool as soon as it is lowered (XLA releases the GIL), so that compiles use the cores
        the lowering, one Python thread, leaves idle. `on_compiled(name, seconds)` is called as
        each program is ready."""
        start = time.perf_counter()
        as_abstract = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)  # noqa: E731
        params_abs = [as_abstract(x) for x in self._params]
        kv_abs = [as_abstract(x) for x in self.kv_pages]
        self._finite_pages = finite_program(kv_abs)  # replace_weights' pass over the pool
        s, i32 = self.layout.max_num_seqs, jnp.int32
        prev_abs = self._abstract((2, s), i32)
        step_abs = self._abstract((self.layout.size,), i32)
        vocab = self.model.config.vocab_size
        logits_abs = self._abstract((s, vocab), jnp.float32)
        all_abs = self._abstract((self.num_scheduler_steps, 2, s), i32)
        counts_abs = self._abstract((s, vocab), i32)
        in_prompt_abs = self._abstract((s, vocab), jnp.bool_)
        # (key, how to lower it), the model's programs first: they take longest to compile.
        to_lower = [
            (("forward", t), lambda t=t: self._forward_fn.lower(
                t, params_abs, kv_abs, prev_abs, logits_abs, step_abs))
            for t in self.buckets
        ] + [
            (("multi", (t, p)), lambda t=t, p=p: self._multi_fns[p].lower(
                t, params_abs, kv_abs, prev_abs, all_abs, step_abs))
            for t, p in self.multi_step_keys
        ] + [
            (("sampler", (p, r)), lambda p=p, r=r: self._sample_fns[p].lower(
                r, prev_abs, logits_abs, step_abs))
            for p, r in self.sampler_keys
        ] + [
            (("top", b), lambda b=b: self._top_fn.lower(b, logits_abs, step_abs))
            for b in self.row_buckets
        ] + [
            (("penalize", b), lambda b=b: self._penalize_fn.lower(
                b, logits_abs, counts_abs, in_prompt_abs, step_abs))
            for b in self.row_buckets
        ] + [
            (("count", None), lambda: self._count_fn.lower(counts_abs, prev_abs, step_abs)),
        ] + [
            (("prompt", (top, b)), lambda top=top, b=b: self._prompt_fn.lower(
                top, b, logits_abs, step_abs))
            for top, b in self.prompt_keys
        ] + [
            (("stage", None), lambda: self._stage_fn.lower(step_abs, step_abs)),
            (("peek", None), lambda: self._peek_fn.lower(prev_abs)),
            (("stage+peek", None), lambda: self._stage_peek_fn.lower(step_abs, step_abs, prev_abs)),
        ]  # fmt: skip
        if self.multi_step_keys:
            to_lower += [
                (("peek", "multi-step"), lambda: self._peek_fn.lower(all_abs)),
                (("stage+peek", "multi-step"),
                 lambda: self._stage_peek_fn.lower(step_abs, step_abs, all_abs)),
            ]  # fmt: skip

        options = self.compiler_options = program_options.for_weights(self.model.quantization)
        logger.info(
            "compiling %d token buckets %s, %d sampler, %d top-logprobs and %d multi-step "
            "programs%s",
            len(self.buckets),
            self.buckets,
            len(self.sampler_keys),
            len(self.row_buckets),
            len(self.multi_step_keys),
            f" with XLA options {options}" if options else "",
        )

        def options_of(key) -> dict:
            """A forward pass's own options where its bucket changes them (program_options)."""
            kind, k = key
            if kind not in ("forward", "multi"):
                return options
            bucket = k if kind == "forward" else k[0]
            return program_options.for_weights(
                self.model.quantization, bucket=bucket, small_matmul=self.model.small_matmul
            )

        def compile_one(key, lowered):
            t0 = time.perf_counter()
            name = _program_name(*key)
            own = self.compiler_options_of[name] = options_of(key)
            exe = lowered.compile(compiler_options=own)
            seconds = time.perf_counter() - t0
            logger.info("%s compiled in %.1fs", name, seconds)
            if on_compiled is not None:
                on_compiled(name, seconds)
            return exe

        with concurrent.futures.ThreadPoolExecutor(
            max_workers=min(16, os.cpu_count() or 4)
        ) as pool:
            futures = {key: pool.submit(compile_one, key, lower()) for key, lower in to_lower}
            # Lowering (tracing the model, lowering its kernels) is Python on this thread, one
            # program after another; the compiles ran beside it.
            logger.info("lowered %d programs in %.1fs", len(futures), time.perf_counter() - start)
            compiled = {key: f.result() for key, f in futures.items()}
        tables = {"forward": self._forwards, "sampler": self._samplers, "multi": self._multis}
        for (kind, key), exe in compiled.items():
            if kind in tables:
                tables[kind][key] = exe
            self._direct[kind, key] = DirectCall(exe)
        self.compile_seconds = time.perf_counter() - start
        logger.info(
            "compiled %d buckets %s, %d sampler programs and %d multi-step programs in %.1fs",
            len(self.buckets),
            self.buckets,
            len(self._samplers),
            len(self._multis),
            self.compile_seconds,
        )

    def direct_launches(self) -> dict[str, bool]:
        """For each program, whether a launch calls its executable directly (direct_call.py) or
        through JAX's dispatcher."""

        return {_program_name(kind, key): call.direct for (kind, key), call in self._direct.items()}

    def compiled_programs(self) -> dict[str, jax.stages.Compiled]:
        """Every compiled program by `_program_name`, for inspection. (Greedy sampling is part of
        every forward pass.)"""
        return {
            _program_name(kind, key): call.compiled for (kind, key), call in self._direct.items()
        }

    def warm_up(self) -> None:
        """Run every compiled bucket and sampler program once on a plan that touches only the
        null page.

        First executions may still build programs (interpret-mode kernels on CPU trace their
        bodies on first use; some backends load or autotune lazily); doing it here keeps the
        serving loop at zero compiles. Each plan has a decode row and a prefill row, so both
        kernel paths run; every slot maps into page 0, whose contents are garbage by design.
        """
        layout = self.layout
        s, mp = layout.max_num_seqs, layout.max_pages_per_seq
        for t in self.buckets:
            t0 = time.perf_counter()
            q_lens = [1, t - 1] if t > 1 and s > 1 else [1]
            q_lens[-1] = min(q_lens[-1], mp * self.page_size)
            n = sum(q_lens)
            step = self._warm_up_step(q_lens)
            tokens = layout.tokens(step, t)
            positions = tokens[TOKEN_FIELDS.index("positions")]
            positions[1:n] = np.arange(n - 1)
            tokens[TOKEN_FIELDS.index("slot_mapping")] = positions % self.page_size
            tokens[TOKEN_FIELDS.index("input_ids")] = 1
            self.fetch(self._launch(t, step, GREEDY))
            logger.info("bucket %d warmed up in %.1fs", t, time.perf_counter() - t0)
        # A sampler program runs the same on any logits: each runs once on the last bucket's,
        # without another forward pass (which costs seconds per layer with interpret-mode
        # kernels on CPU).
        for key in [("sampler", k) for k in self._samplers]:
            self._samples_state = self._direct[key](
                [self._samples_state, self._logits_state, self._step_state]
            )[0]
            self.fetch(self._direct["peek", None]([self._samples_state])[0])
        for bucket in self.row_buckets:  # (no rows listed: the output is dropped)
            np.asarray(self._direct["top", bucket]([self._logits_state, self._step_state])[0])
        self._penalize_and_count(self._warm_up_step([1]))
        np.asarray(self._penalty_counts)
        for key in self.prompt_keys:  # (no rows listed: its output is dropped)
            np.asarray(self._direct["prompt", key]([self._logits_state, self._step_state])[0])
        # Each multi-step program once, on one decode row that writes the null page.
        step = self._warm_up_step([1])
        layout.view(step, "decode_steps")[0] = 1
        for t, program in self._multis:
            self.fetch(self._launch(t, step, program, self.num_scheduler_steps))
        # Each staging program that also copies the last launch's samples, once on its own.
        for source in [None] + (["multi-step"] if self._multis else []):
            self._step_state, peeked = self._direct["stage+peek", source](
                [self._step_state, self._put_step(layout.new_step()), self._samples_buffer(source)]
            )
            self.fetch(peeked)

    def _warm_up_step(self, q_lens: list[int]) -> np.ndarray:
        """A step buffer of one decode row then the given rows, every other row padding, with
        sampling settings that every sampler program reads (random, top-k, top-p)."""
        layout, s = self.layout, self.layout.max_num_seqs
        step = layout.new_step()
        cu = layout.view(step, "cu_q_lens")
        cu[1 : len(q_lens) + 1] = np.cumsum(q_lens)
        cu[len(q_lens) + 1 :] = sum(q_lens)
        layout.view(step, "kv_lens")[: len(q_lens)] = q_lens
        layout.view(step, "distribution")[:] = (1, len(q_lens))
        layout.view(step, "logits_indices")[:] = np.maximum(cu[1:] - 1, 0)
        layout.view(step, "temperature")[:] = 1.0
        layout.view(step, "top_p")[:] = 0.9
        layout.view(step, "top_k")[:] = 5
        layout.view(step, "filter_rows")[:] = np.arange(s)
        return step

    def replace_weights(self, prepared: list[PreparedTensor]) -> None:
        """Run on new weights from the next launch (weights/update.py: checked, laid out on the
        host), each placed as the array it replaces and swapped in at once; the caller makes
        sure no launch is in flight. The launch's own references go first, so each old array
        is freed as its successor lands. The KV pages lose any NaN or inf the old weights wrote
        (kv_cache.finite_program), which masked positions would otherwise carry over."""
        self._unpack_state()
        try:
            replace_weights(self.model, prepared)
        finally:  # after a failure too: the launch takes whatever the state now holds
            if not self._asleep:  # (asleep: wake_up packs them, and allocates fresh pages)
                self._pack_state()
                self.kv_pages = self._finite_pages(self.kv_pages)

    def launch(self, plan: StepPlan) -> LaunchedSamples:
        """Enqueue the step and return a handle to its samples without waiting (`fetch` reads
        it).

        The device runs launched steps in order, so a step may read pages or tokens that the
        previous one is still writing.
        """
        return self._launch(plan.bucket, plan.buffer, plan.sampler, plan.num_steps)

    def launch_buffer(
        self, bucket: int, step: np.ndarray, program: SamplerProgram, num_steps: int = 1
    ) -> jax.Array:
        """`launch` from a plan's parts: what a follower of a multi-host engine runs, with the
        buffer process 0 sent it (executor/multihost.py). Returns the samples' copy at once
        (the follower waits on it to report the step done, whether or not another follows)."""
        handle = self._launch(bucket, step, program, num_steps)
        self._peek_now(handle)
        return handle.array

    def _top_logprobs(self, step: np.ndarray) -> tuple[jax.Array, int] | None:
        """The step's top logprobs, if it lists rows for them: (output on its way to the host,
        rows)."""
        n, bucket = self._listed(step, "top_rows")
        if not n:
            return None
        out = self._direct["top", bucket]([self._logits_state, self._step_state])[0]
        out.copy_to_host_async()
        return out, n

    def _prompt_logprobs(self, step: np.ndarray) -> tuple[jax.Array, int, int] | None:
        """The step's prompt logprobs, if it has prompt-logprob rows: (output on its way to the
        host, rows, top)."""
        n, bucket = self._listed(step, "prompt_logprob_rows")
        if not n:
            return None
        top = int(self.layout.view(step, "prompt_logprob_top")[0])
        out = self._direct["prompt", (top, bucket)]([self._logits_state, self._step_state])[0]
        out.copy_to_host_async()
        return out, n, top

    def _listed(self, step: np.ndarray, field: str) -> tuple[int, int]:
        """(entries, the bucket of rows that holds them) of a list field of the step's buffer
        (penalty rows, prompt-logprob rows: entries first, then max_num_seqs); (0, 0): none."""
        s, listed = self.layout.max_num_seqs, self.layout.view(step, field)
        if listed[0] >= s:  # none (the common step): no pass over the field
            return 0, 0
        n = int(np.count_nonzero(listed < s))
        return n, next(b for b in self.row_buckets if b >= n)

    def _penalty_bucket(self, step: np.ndarray) -> int:
        """The bucket that holds the step's rows with a penalty (0: none)."""
        return self._listed(step, "penalty_rows")[1]

    def _penalize(self, bucket: int) -> None:
        self._logits_state, self._penalty_counts, self._penalty_in_prompt = self._direct[
            "penalize", bucket
        ]([self._logits_state, self._penalty_counts, self._penalty_in_prompt, self._step_state])

    def _count(self) -> None:
        self._penalty_counts = self._direct["count", None](
            [self._penalty_counts, self._samples_state, self._step_state]
        )[0]

    def _penalize_and_count(self, step: np.ndarray) -> None:
        """Warm-up: the penalty programs once each, on `step` staged (no row listed: no change)."""
        self._step_state = self._direct["stage", None]([self._step_state, self._put_step(step)])[0]
        for bucket in self.row_buckets:
            self._penalize(bucket)
        self._count()

    def _launch(
        self, bucket: int, step: np.ndarray, program: SamplerProgram, num_steps: int = 1
    ) -> LaunchedSamples:
        key = ("forward", bucket) if num_steps == 1 else ("multi", (bucket, program))
        call = self._direct.get(key)
        if call is None or (num_steps > 1 and num_steps != self.num_scheduler_steps):
            if num_steps == 1:
                raise RuntimeError(f"bucket {bucket} was not compiled (buckets: {self.buckets})")
            raise RuntimeError(
                f"no multi-step program of {num_steps} steps for bucket {bucket} and sampler "
                f"{program.name} (compiled: {self.num_scheduler_steps} steps, "
                f"{sorted((t, p.name) for t, p in self._multis)})"
            )
        t0 = time.perf_counter()
        fresh = self._put_step(step)
        last, self._unpeeked = self._unpeeked, None
        if last is None:
            self._step_state = self._direct["stage", None]([self._step_state, fresh])[0]
        else:  # the last launch's samples are copied for the host on the way
            self._step_state, last.array = self._direct["stage+peek", last.source](
                [self._step_state, fresh, self._samples_buffer(last.source)]
            )
            self._copy_back(last.array)
        t1 = time.perf_counter()
        multi = num_steps > 1  # the forward passes and samplers of every step in one program
        # The program's second own buffer: every step's samples (multi-step), or the logits.
        own = self._all_samples_state if multi else self._logits_state
        out = call([*self._params, *self.kv_pages, self._samples_state, own, self._step_state])
        t2 = time.perf_counter()
        if multi:
            self._all_samples_state, self._samples_state = out[:2]
            handle = self._unpeeked = LaunchedSamples("multi-step")
        else:
            self._samples_state, self._logits_state = out[:2]
            rows = logit_rows(self.layout.max_num_seqs, bucket)
            # Read from the buffer, so a follower of a multi-host engine runs them too.
            penalties = self._penalty_bucket(step)
            if penalties:
                self._penalize(penalties)
            # The forward pass sampled greedily; this step needs more, or penalized logits do.
            if program != GREEDY or penalties:
                self._samples_state = self._direct["sampler", (program, rows)](
                    [self._samples_state, self._logits_state, self._step_state]
                )[0]
            if penalties:
                self._count()
            handle = self._unpeeked = LaunchedSamples()
            # Read from the buffer, so a follower of a multi-host engine runs them too.
            handle.top = self._top_logprobs(step)
            handle.prompt = self._prompt_logprobs(step)
        # (the next launch copies the samples for the host, or fetch does)
        self.kv_pages = out[2:]
        lt = self.launch_times
        lt.transfer += t1 - t0
        lt.forward += t2 - t1
        lt.sampler += time.perf_counter() - t2
        return handle

    def _copy_back(self, samples: jax.Array) -> None:
        if self.copy_back_early:  # so that fetching later does not add a round trip
            samples.copy_to_host_async()

    def _peek_now(self, handle: LaunchedSamples) -> None:
        """The host's copy of the last launch's samples, where no later launch made it."""
        if handle.array is None:
            if handle is not self._unpeeked:
                raise RuntimeError("these samples were neither copied nor the last launch's")
            self._unpeeked = None
            handle.array = self._direct["peek", handle.source](
                [self._samples_buffer(handle.source)]
            )[0]

    def fetch(self, handle: LaunchedSamples | jax.Array) -> tuple:
        """Wait for a launched step's samples: (tokens int32[S], logprobs float32[S], top
        logprobs, prompt logprobs), with a leading [K] on the first two for a multi-step launch.
        Top logprobs: (token ids int32[N, TOP_LOGPROBS], their logprobs float32[N, TOP_LOGPROBS])
        of the step's N `top_rows`, or None. Prompt logprobs: (ids int32[L, 1 + top], logprobs
        float32[L, 1 + top]) of the step's prompt-logprob rows (the target's first), or None."""
        top = prompt = None
        if isinstance(handle, LaunchedSamples):
            self._peek_now(handle)
            if handle.top is not None:
                out, n = handle.top
                pairs = np.asarray(out).reshape(2, -1, TOP_LOGPROBS)[:, :n]
                top = (pairs[0], pairs[1].view(np.float32))
            if handle.prompt is not None:
                out, n, k = handle.prompt
                pairs = np.asarray(out).reshape(2, -1, 1 + k)[:, :n]
                prompt = (pairs[0], pairs[1].view(np.float32))
            handle = handle.array
        samples = np.asarray(handle)
        return (samples[..., 0, :], samples[..., 1, :].view(np.float32), top, prompt)

    def step(self, plan: StepPlan) -> tuple:
        """Launch and wait: the synchronous step."""
        return self.fetch(self.launch(plan))
