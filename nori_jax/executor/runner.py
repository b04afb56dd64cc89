"""The device side: a jitted forward pass per token bucket and a few small programs, all compiled
ahead of time.

    stage(step_state, fresh) -> step_state          the step's packed buffer, in place
    stage+peek(step_state, fresh, samples) -> (step_state, a copy of the last step's samples)
    forward[T](params, kv_pages, samples, logits, step_state) -> (samples, logits, kv_pages)
    sample[program, R](samples, logits, step_state) -> samples
    peek(samples) -> a copy for the host

`samples` int32[2, S] packs each row's token (row 0) and its logprob's float32 bits (row 1);
`logits` is float32[S, V], of which a step of T tokens fills the first R = min(S, T) rows
(`logit_rows`: a bucket of T holds at most T rows). The forward pass samples greedily itself, so a
greedy step runs no sampler program; another step runs the one `sampling_modes.choose_program`
picked. Decode rows whose input is the previous step's sample read it from `samples` on the device
(`prev_index`), which lets the host plan step N+1 while step N runs.

**Buffers that never move.** XLA runs each program as a CUDA graph, and a launch after any of the
graph's buffers moved updates and re-uploads the graph first: on the H200 a chain of 400 kernels
launched in 1.9 ms whenever one input or output was a fresh array, against 0.8 ms with none
(benchmarks/engine/graph_launch_bench.py; docs/benchmarks.md). So every buffer of the forward pass
keeps its address from launch to launch: `params` never change, and the runner owns one device
buffer each for the KV pages, `samples`, `logits` and the step buffer, which each program takes
donated and returns in place. A step's fresh host-to-device buffer goes through `stage` (a one-
kernel program, cheap to update), and the host reads the samples through a copy (the runner's
own buffer is donated to the next launch before the host reads it). That copy is made by the next
launch's staging program ("stage+peek"): in an overlapped engine the next step is launched before
the host fetches this one, and one program per launch fewer saves a launch's worth of host time.
A fetch that finds no later launch makes the copy itself (`peek`). The parameters go in
as a flat list prepared once; a launch hands its flat argument list straight to each program's
executable (direct_call.py), past JAX's per-argument dispatch checks.

The random and filtering samplers are programs of their own, so their variants
(sampling_modes.py) cost a handful of small compiles rather than more forward passes per bucket,
and the step never branches on device data.

Multi-step decode (`num_scheduler_steps` K > 1) adds one program per (small bucket, sampler
program) that runs both K times in a scan:

    multi_step[bucket, program](params, kv_pages, samples, all_samples, step_state)
        -> (all_samples int32[K, 2, S], samples, kv_pages)

Its last step's samples are the next launch's `samples`; `all_samples` is the runner's own buffer
too (donated, returned in place), and the host's copy of it is made as for one step
("stage+peek multi-step", "peek multi-step").
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import os
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nori_jax.core.sampling_modes import (
    GREEDY,
    SamplerProgram,
    multi_step_programs,
    sampler_programs,
)
from nori_jax.core.step_layout import TOKEN_FIELDS, StepLayout
from nori_jax.core.step_plan import StepPlan
from nori_jax.executor.direct_call import DirectCall
from nori_jax.executor.kv_cache import allocate_kv_pages, kv_sharding
from nori_jax.executor.mesh import replicated
from nori_jax.executor.placement import ReplicatedPut, put
from nori_jax.executor.sampler import sample
from nori_jax.executor.step_inputs import unpack_rows, unpack_tokens
from nori_jax.models.linear import MODEL
from nori_jax.models.llama import AttentionInputs
from nori_jax.weights.loader import LoadedModel

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class LaunchTimes:
    """Cumulative host time inside `launch`, by part (seconds): where a launch waits, if it does."""

    # the step buffer's host-to-device transfer and its staging program (which copies the last
    # launch's samples and starts their copy back)
    transfer: float = 0.0
    forward: float = 0.0  # dispatch of the forward pass (or multi-step program)
    sampler: float = 0.0  # a sampler program (not greedy steps)


def _model(graphdef, treedef, params, kv_scales):
    # Calibrated fp8 scales are constants of the program (known before it compiles): no buffer.
    kv_scales = None if kv_scales is None else jnp.asarray(kv_scales, jnp.float32)
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, params)), kv_scales


def _stage(state, fresh):
    """The step's fresh buffer into the runner's own (donated, so its address never changes)."""
    return jax.lax.dynamic_update_slice(state, fresh, (0,))


def _peek(samples):
    """A copy of the samples for the host: the runner's own buffer goes to the next launch."""
    return samples + 0


def _stage_and_peek(state, fresh, samples):
    """`_stage` of this launch and `_peek` of the last one's samples, in one program: their
    buffer is still the last step's output here, before this step's forward pass takes it."""
    return _stage(state, fresh), _peek(samples)


class LaunchedSamples:
    """A launched step's samples: `array` is the host's copy (int32[2, S], or [K, 2, S] from a
    multi-step launch), None until the next launch or `fetch` makes it from the runner's buffer
    (`source`: None for `samples`, "multi-step" for `all_samples`)."""

    __slots__ = ("array", "source")

    def __init__(self, source: str | None = None):
        self.array: jax.Array | None = None
        self.source = source


def _input_ids(tok, prev_samples):
    """The step's token ids, with the previous launch's samples where `prev_index` points."""
    prev = tok["prev_index"]
    return jnp.where(prev >= 0, prev_samples[0, jnp.maximum(prev, 0)], tok["input_ids"])


def _pack(tokens, logprobs):
    """int32[..., 2, S]: the tokens, then the logprobs' float32 bits (one array to copy back)."""
    return jnp.stack([tokens, jax.lax.bitcast_convert_type(logprobs, jnp.int32)], axis=-2)


def logit_rows(max_num_seqs: int, bucket: int) -> int:
    """R: the rows whose logits a step of `bucket` tokens computes. A row has at least one token,
    so a bucket of T holds at most T rows: the LM head and the sampler skip the other padding
    rows (at 64 sequences, 1,024 rows of LM head, float32 logits and their reductions cost about
    0.2 ms a step on an H200)."""
    return min(max_num_seqs, bucket)


def _pad_rows(samples, max_num_seqs):
    """int32[..., 2, R] -> int32[..., 2, S]: what the host reads and the next step's input."""
    pad = max_num_seqs - samples.shape[-1]
    return jnp.pad(samples, [(0, 0)] * (samples.ndim - 1) + [(0, pad)]) if pad else samples


def _logits(
    model,
    kv_scales,
    logits_shardings,
    num_rows,
    row,
    input_ids,
    positions,
    slot_mapping,
    kv_lens,
    kv_pages,
):
    """float32[R, V] logits of the first `num_rows` rows' last tokens, replicated, and the new
    pages.

    On a tensor-parallel mesh the LM head is split by vocab: its logits are computed on each
    device's vocab slice, then gathered once (`logits_shardings`: (split, replicated)). Left to
    itself, XLA moves the gather elsewhere once sampling follows in the same program (sampling
    from vocab shards: three more collectives; or gathering the whole LM head weight)."""
    meta = AttentionInputs(
        slot_mapping=slot_mapping,
        kv_lens=kv_lens,
        page_table=row["page_table"],
        cu_q_lens=row["cu_q_lens"],
        distribution=row["distribution"],
    )
    hidden, kv_pages = model(input_ids, positions, kv_pages, meta, kv_scales)
    logits = model.compute_logits(hidden[row["logits_indices"][:num_rows]])  # [R, V]
    for sharding in logits_shardings:
        logits = jax.lax.with_sharding_constraint(logits, sharding)
    return logits, kv_pages


def _forward(
    graphdef,
    treedef,
    layout,
    kv_scales,
    logits_shardings,
    bucket,
    params,
    kv_pages,
    prev_samples,
    logits_state,
    step,
):
    model, kv_scales = _model(graphdef, treedef, params, kv_scales)
    tok, row = unpack_tokens(layout, step, bucket), unpack_rows(layout, step)
    logits, kv_pages = _logits(
        model,
        kv_scales,
        logits_shardings,
        logit_rows(layout.max_num_seqs, bucket),
        row,
        _input_ids(tok, prev_samples),
        tok["positions"],
        tok["slot_mapping"],
        row["kv_lens"],
        kv_pages,
    )
    # Greedy sampling in the same program: a greedy step needs no second launch. (The argmax and
    # log-sum-exp are one pass over the logits, which the sampler programs would make anyway.)
    greedy = _pack(*_sample_row(GREEDY, logits, row, row["sample_index"]))
    if logits.shape[0] < logits_state.shape[0]:  # R < S rows: into the first R
        logits = jax.lax.dynamic_update_slice(logits_state, logits, (0, 0))
    return _pad_rows(greedy, layout.max_num_seqs), logits, kv_pages


def _sample_row(program, logits, row, sample_index):
    """(tokens int32[R], logprobs float32[R]) of the logits' R rows."""
    r = logits.shape[0]
    return sample(
        logits,
        row["temperature"][:r],
        row["top_p"][:r],
        row["top_k"][:r],
        row["seeds"][:r],
        sample_index[:r],
        row["filter_rows"],  # indices of rows < R, then padding (S), which the sampler drops
        program=program,
    )


def _sample(layout, program, rows, samples, logits_state, step):
    """New `samples` (the forward pass's greedy ones, donated) from the first `rows` logits."""
    del samples  # its buffer becomes the output's
    row = unpack_rows(layout, step)
    out = _pack(*_sample_row(program, logits_state[:rows], row, row["sample_index"]))
    return _pad_rows(out, layout.max_num_seqs)


def _multi_step(
    graphdef,
    treedef,
    layout,
    kv_scales,
    logits_shardings,
    page_size,
    num_steps,
    program,
    bucket,
    params,
    kv_pages,
    prev_samples,
    all_samples,
    step,
):
    """`num_steps` decode steps in one program: forward pass and sampler, each step's samples
    the next one's inputs, in a `lax.scan` of static length (XLA knows its trip count: no host
    synchronization). The plan holds decode rows only (token j is row j). Row i computes its
    first `decode_steps[i]` steps; in the later ones its token writes the null page and reads
    its last real length, and its samples are garbage the host drops.

    Returns (samples int32[k, 2, S], the last step's samples int32[2, S] (the next launch's
    `prev_samples`), kv_pages).
    """
    model, kv_scales = _model(graphdef, treedef, params, kv_scales)
    tok, row = unpack_tokens(layout, step, bucket), unpack_rows(layout, step)
    s, t = layout.max_num_seqs, bucket
    r = logit_rows(s, t)
    token_row = jnp.minimum(jnp.arange(t), r - 1)
    is_row = jnp.arange(t) < row["distribution"][0]
    token_steps = jnp.where(is_row, row["decode_steps"][token_row], 0)  # int32[T]
    row_steps = jnp.maximum(row["decode_steps"], 1)  # int32[S]; padding rows: 1
    page_table, positions0 = row["page_table"], tok["positions"]
    pages_per_seq = page_table.shape[1]

    def one_step(carry, i):
        kv_pages, input_ids = carry
        active = i < token_steps
        positions = positions0 + i
        page = jnp.minimum(positions // page_size, pages_per_seq - 1)
        slot = page_table[token_row, page] * page_size + positions % page_size
        slot_mapping = jnp.where(active, slot, 0)  # done rows and padding: the null page
        kv_lens = row["kv_lens"] + jnp.where(row["kv_lens"] > 0, jnp.minimum(i, row_steps - 1), 0)
        logits, kv_pages = _logits(
            model,
            kv_scales,
            logits_shardings,
            r,
            row,
            input_ids,
            positions,
            slot_mapping,
            kv_lens,
            kv_pages,
        )
        sampled, logprobs = _sample_row(program, logits, row, row["sample_index"] + i)
        next_ids = jnp.where(is_row, sampled[token_row], 0)
        return (kv_pages, next_ids), _pack(sampled, logprobs)

    del all_samples  # its buffer becomes the first output's
    (kv_pages, _), samples = jax.lax.scan(
        one_step, (kv_pages, _input_ids(tok, prev_samples)), jnp.arange(num_steps, dtype=jnp.int32)
    )
    samples = _pad_rows(samples, s)
    return samples, samples[-1], kv_pages


def _program_name(kind: str, key) -> str:
    """ "bucket 128", "sampler random (64 rows)", "multi-step bucket 16 greedy", "stage",
    "stage+peek", "peek", "peek multi-step": a program's name in the start-up log and for inspection
    (compiled_programs)."""
    if kind == "sampler":
        return f"sampler {key[0].name} ({key[1]} rows)"
    if kind == "multi":
        return f"multi-step bucket {key[0]} {key[1].name}"
    if kind in ("stage", "stage+peek", "peek"):
        return kind if key is None else f"{kind} {key}"
    return f"bucket {key}"


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
    ):
        """`kv_dtype`: the KV pages' dtype (None: the model's; an fp8 dtype for 8-bit pages).
        `kv_scales`: float32[num_layers, 2] of fp8 pages (kv_calibration.py); None: 1.0.
        `num_scheduler_steps` > 1: multi-step programs for the buckets and sampler programs a
        launch of at most `multi_step_max_seqs` decode rows can need."""
        self.model = loaded
        self.mesh = mesh
        self.num_pages, self.page_size = num_pages, page_size
        self.layout = layout
        self.buckets = list(buckets)
        cfg = loaded.config
        kv_dtype = loaded.dtype if kv_dtype is None else kv_dtype
        self.kv_pages = allocate_kv_pages(cfg, num_pages, page_size, kv_dtype, mesh)
        self.kv_scales = kv_scales
        self._params, treedef = jax.tree.flatten(loaded.state)
        # Sharding objects built once: a fresh one per call misses jit's fast dispatch path.
        self._replicated = replicated(mesh)
        self._kv_sharding = kv_sharding(mesh)
        logits_shardings = (NamedSharding(mesh, PartitionSpec(None, MODEL)), self._replicated)
        # One program per bucket (`bucket`, static, says how many token slots of the step
        # buffer it reads); the buffer's shape is the same for all.
        self._forward_fn = jax.jit(
            functools.partial(
                _forward, loaded.graphdef, treedef, layout, kv_scales, logits_shardings
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
        # The random and filtering samplers, per (program, logit rows R) a step of some bucket
        # can need (the forward pass samples greedily itself).
        self.sampler_keys = sorted(
            {
                (program, r)
                for r in {logit_rows(layout.max_num_seqs, t) for t in self.buckets}
                for program in sampler_programs(layout.max_num_seqs, r)
                if program != GREEDY
            }
        )
        self._sample_fns = {
            program: jax.jit(
                functools.partial(_sample, layout, program),
                static_argnums=(0,),
                donate_argnums=(1,),
                keep_unused=True,
                out_shardings=self._replicated,
            )
            for program in {p for p, _ in self.sampler_keys}
        }
        self._stage_fn = jax.jit(_stage, donate_argnums=(0,), out_shardings=self._replicated)
        self._peek_fn = jax.jit(_peek, out_shardings=self._replicated)
        self._stage_peek_fn = jax.jit(
            _stage_and_peek, donate_argnums=(0,), out_shardings=self._replicated
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
                    _multi_step,
                    loaded.graphdef,
                    treedef,
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
        self.launch_times = LaunchTimes()
        self._put_step = ReplicatedPut((layout.size,), np.int32, self._replicated)
        # Start each step's device-to-host copy at launch (fetch then finds the samples on the
        # host), or let fetch copy them once the step is done.
        self.copy_back_early = True
        # The device buffers every step reads and writes in place (module docstring: their
        # addresses never change, so XLA's CUDA graphs launch without an update).
        s, vocab = layout.max_num_seqs, cfg.vocab_size
        self._step_state = put(layout.new_step(), self._replicated)
        self._samples_state = put(np.zeros((2, s), np.int32), self._replicated)
        self._logits_state = put(np.zeros((s, vocab), np.float32), self._replicated)
        k = num_scheduler_steps
        self._all_samples_state = (
            put(np.zeros((k, 2, s), np.int32), self._replicated) if self.multi_step_keys else None
        )
        # The last launch's samples while only the runner's buffer holds them (no copy yet).
        self._unpeeked: LaunchedSamples | None = None

    def _samples_buffer(self, source: str | None) -> jax.Array:
        """The runner's buffer a LaunchedSamples of `source` is copied from."""
        return self._samples_state if source is None else self._all_samples_state

    def _abstract(self, shape, dtype) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=self._replicated)

    def compile_all(self, on_compiled: Callable[[str, float], None] | None = None) -> None:
        """Lower every bucket and sampler program, then compile them in parallel (XLA releases
        the GIL). `on_compiled(name, seconds)` is called as each program is ready."""
        start = time.perf_counter()
        as_abstract = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)  # noqa: E731
        params_abs = [as_abstract(x) for x in self._params]
        kv_abs = [as_abstract(x) for x in self.kv_pages]
        s, i32 = self.layout.max_num_seqs, jnp.int32
        prev_abs = self._abstract((2, s), i32)
        step_abs = self._abstract((self.layout.size,), i32)
        vocab = self.model.config.vocab_size
        logits_abs = self._abstract((s, vocab), jnp.float32)
        lowered = {
            ("forward", t): self._forward_fn.lower(
                t, params_abs, kv_abs, prev_abs, logits_abs, step_abs
            )
            for t in self.buckets
        }
        lowered.update(
            {
                ("sampler", (p, r)): self._sample_fns[p].lower(r, prev_abs, logits_abs, step_abs)
                for p, r in self.sampler_keys
            }
        )
        lowered["stage", None] = self._stage_fn.lower(step_abs, step_abs)
        lowered["peek", None] = self._peek_fn.lower(prev_abs)
        lowered["stage+peek", None] = self._stage_peek_fn.lower(step_abs, step_abs, prev_abs)
        all_abs = self._abstract((self.num_scheduler_steps, 2, s), i32)
        if self.multi_step_keys:
            lowered["peek", "multi-step"] = self._peek_fn.lower(all_abs)
            lowered["stage+peek", "multi-step"] = self._stage_peek_fn.lower(
                step_abs, step_abs, all_abs
            )
        lowered.update(
            {
                ("multi", (t, p)): self._multi_fns[p].lower(
                    t, params_abs, kv_abs, prev_abs, all_abs, step_abs
                )
                for t, p in self.multi_step_keys
            }
        )

        logger.info(
            "compiling %d token buckets %s and %d sampler programs",
            len(self.buckets),
            self.buckets,
            len(self.sampler_keys),
        )

        def compile_one(key):
            t0 = time.perf_counter()
            exe = lowered[key].compile()
            name = _program_name(*key)
            seconds = time.perf_counter() - t0
            logger.info("%s compiled in %.1fs", name, seconds)
            if on_compiled is not None:
                on_compiled(name, seconds)
            return exe

        with concurrent.futures.ThreadPoolExecutor(
            max_workers=min(16, os.cpu_count() or 4)
        ) as pool:
            compiled = dict(zip(lowered, pool.map(compile_one, lowered), strict=True))
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
        for program, r in self._samplers:
            self._samples_state = self._direct["sampler", (program, r)](
                [self._samples_state, self._logits_state, self._step_state]
            )[0]
            self.fetch(self._direct["peek", None]([self._samples_state])[0])
        # The staging program that also copies the last launch's samples, once on its own.
        self._step_state, peeked = self._direct["stage+peek", None](
            [self._step_state, self._put_step(layout.new_step()), self._samples_state]
        )
        self.fetch(peeked)
        # Each multi-step program once, on one decode row that writes the null page.
        step = self._warm_up_step([1])
        layout.view(step, "decode_steps")[0] = 1
        for t, program in self._multis:
            self.fetch(self._launch(t, step, program, self.num_scheduler_steps))
        if self._multis:
            self._step_state, peeked = self._direct["stage+peek", "multi-step"](
                [self._step_state, self._put_step(layout.new_step()), self._all_samples_state]
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
        if num_steps > 1:  # the forward passes and samplers of every step in one program
            out = call(
                [
                    *self._params,
                    *self.kv_pages,
                    self._samples_state,
                    self._all_samples_state,
                    self._step_state,
                ]
            )
            t2 = time.perf_counter()
            self._all_samples_state, self._samples_state = out[:2]
            handle = self._unpeeked = LaunchedSamples("multi-step")
        else:
            out = call(
                [
                    *self._params,
                    *self.kv_pages,
                    self._samples_state,
                    self._logits_state,
                    self._step_state,
                ]
            )
            t2 = time.perf_counter()
            self._samples_state, self._logits_state = out[:2]
            if program != GREEDY:  # the forward pass sampled greedily; this step needs more
                rows = logit_rows(self.layout.max_num_seqs, bucket)
                self._samples_state = self._direct["sampler", (program, rows)](
                    [self._samples_state, self._logits_state, self._step_state]
                )[0]
            handle = self._unpeeked = LaunchedSamples()
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

    def fetch(self, handle: LaunchedSamples | jax.Array) -> tuple[np.ndarray, np.ndarray]:
        """Wait for a launched step's samples: (tokens int32[S], logprobs float32[S]), or
        [K, S] each for a multi-step launch."""
        if isinstance(handle, LaunchedSamples):
            self._peek_now(handle)
            handle = handle.array
        samples = np.asarray(handle)
        return samples[..., 0, :], samples[..., 1, :].view(np.float32)

    def step(self, plan: StepPlan) -> tuple[np.ndarray, np.ndarray]:
        """Launch and wait: the synchronous step."""
        return self.fetch(self.launch(plan))
