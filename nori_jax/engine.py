"""LLMEngine: the engine in one process: add_request / step / abort.

It puts together the three parts vLLM's v1 engine has: the frontend (tokenization, validation,
the output processor with detokenization and stop strings, metrics), the engine core (scheduler,
plan builder, step loop; `core/engine_core.py`) and the executor (the model on the device;
`executor/runner.py`). The offline `LLM` drives it in a loop; the server runs the same core in a
process of its own (engine_core_process.py) and the frontend in the API server.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from nori_jax.core.engine_core import EngineCore, EngineCoreRequest, check_priority
from nori_jax.core.output_processor import OutputProcessor
from nori_jax.core.outputs import EngineCoreOutputs, RequestOutput
from nori_jax.core.paging import PageAllocator
from nori_jax.core.plan_builder import PlanBuilder
from nori_jax.core.scheduler import Scheduler
from nori_jax.core.scheduler_config import SchedulerConfig
from nori_jax.core.step_shapes import StepShapes
from nori_jax.engine_config import EngineConfig
from nori_jax.executor import compilation_cache, distributed, gpu_client, xla_flags
from nori_jax.executor.compile_counter import CompileCounter
from nori_jax.executor.kv_cache import num_pages_for_memory
from nori_jax.executor.kv_calibration import calibration_token_ids, measure_kv_scales
from nori_jax.executor.mesh import make_mesh
from nori_jax.executor.multihost import LeaderExecutor
from nori_jax.executor.runner import ModelRunner
from nori_jax.mesh_config import MeshConfig, Role
from nori_jax.metrics import EngineMetrics
from nori_jax.prompts import encode_prompt
from nori_jax.sampling_params import SamplingParams
from nori_jax.tokenizer import Tokenizer
from nori_jax.weight_control import WeightControl, swap_refusal
from nori_jax.weights.loader import LoadedModel, load_model, resolve_dtype
from nori_jax.weights.update import Tensors
from pallas_kernels.kv_layout import is_fp8, kv_page_dtype
from pallas_kernels.ragged_paged_attention.api import BACKENDS, kernel_runs
from pallas_kernels.ragged_paged_attention.pallas_attention import FP8_MIN_PAGE_SIZE
from pallas_kernels.ragged_paged_attention.tuning_overrides import (
    TuningOverrides,
    format_overrides,
    parse_tuning_overrides,
)

logger = logging.getLogger(__name__)


def make_engine(config: EngineConfig) -> LLMEngine:
    """The in-process engine for `config`: an LLMEngine, or a ReplicatedEngine (same API) when
    the mesh has several data-parallel replicas."""
    if config.mesh.data > 1:
        from nori_jax.replicated_engine import ReplicatedEngine

        return ReplicatedEngine(config)
    return LLMEngine(config)


def resolve_attention_backend(name: str) -> str:
    """'auto' is the Pallas kernel on GPU when it is built, the jnp reference elsewhere."""
    if name != "auto":
        if name not in BACKENDS:
            raise ValueError(f"attention_backend={name!r} is not available; built: {BACKENDS}")
        return name
    return "pallas" if jax.default_backend() == "gpu" and "pallas" in BACKENDS else "reference"


def resolve_attention_tuning(
    text: str | None, attention_backend: str, *, dtype, platform: str
) -> TuningOverrides:
    """EngineConfig.attention_tuning as the kernel's (field, value) pairs; ValueError where it is
    malformed or the attention is not the Pallas kernel's: the reference has no schedule, and a
    float32 model on a GPU attends on the reference path (api.py: wgmma takes float32 only as
    tf32), so an override there would do nothing."""
    if text is None:
        return ()
    if attention_backend != "pallas":
        raise ValueError(
            f"attention_tuning={text!r} sets the Pallas attention kernel's schedule; "
            f"attention_backend resolves to {attention_backend!r} (set attention_backend='pallas')"
        )
    if not kernel_runs(dtype, platform):
        raise ValueError(
            f"attention_tuning={text!r} sets the Pallas attention kernel's schedule; a float32 "
            "model on a GPU attends on the reference path, which has none (set dtype='bfloat16')"
        )
    return parse_tuning_overrides(text)


def resolve_quantized_matmul(config: EngineConfig) -> str:
    """'auto' is "upcast" for fp8 weights (weight-only through XLA in calls of up to 64 tokens:
    the 8B engine 2.4-2.9% faster than with the fp8 GEMM there, H100, alternating; XLA partitions
    it under tensor parallelism; the skinny kernel measured even, 0.98x), the skinny-matmul
    kernel for int4 weights on a GPU with one device per replica (the 8B engine ran 1.47x faster
    on it than on XLA's int4 form, same H100 call), XLA's dot otherwise: int8 weights faster on
    XLA (8B, 64 sequences, H100: 8,031-8,044 against 7,372-7,424 total tok/s), and on CPU the
    kernel only runs interpreted."""
    if config.quantized_matmul != "auto":
        return config.quantized_matmul
    if config.quantization == "fp8":
        return "upcast"
    kernel = (
        config.quantization == "int4" and config.mesh.model == 1 and jax.default_backend() == "gpu"
    )
    return "pallas" if kernel else "xla"


class CountedRunner:
    """The runner as the engine core's executor, counting any program built while it runs."""

    def __init__(self, runner: ModelRunner | LeaderExecutor):
        self.runner = runner
        self._compiles = CompileCounter()

    @property
    def num_recompiles(self) -> int:
        return self._compiles.count

    def launch(self, plan):
        with self._compiles.counting():
            return self.runner.launch(plan)

    def fetch(self, handle):
        with self._compiles.counting():
            return self.runner.fetch(handle)


@dataclasses.dataclass
class EngineParts:
    """An engine core on a model, built and compiled: what both LLMEngine and the engine-core
    process run."""

    config: EngineConfig
    core: EngineCore
    model: LoadedModel
    runner: ModelRunner
    scheduler_config: SchedulerConfig
    max_model_len: int
    load_seconds: float
    gpu_client: str = "none"  # XLA's GPU runtime the engine runs on (tfrt, default; none: no GPU)

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.model.tokenizer

    @property
    def config_info(self) -> dict[str, str]:
        """What runs (dtype, weights, KV pages, the GPU runtime), for the log and
        nori:model_config_info."""
        scales = "none"
        if self.runner.kv_scales is not None:
            scales = "calibrated"
        elif self.kv_cache_dtype.startswith("float8"):
            scales = "default"
        return self.model.model_config_info | {
            "kv_cache_dtype": self.kv_cache_dtype,
            "kv_scales": scales,
            "gpu_client": self.gpu_client,
        }

    @property
    def kv_cache_dtype(self) -> str:
        return jnp.dtype(self.runner.kv_pages[0].dtype).name

    @property
    def eos_token_ids(self) -> list[int]:
        tok = self.model.tokenizer
        return list(tok.eos_token_ids if tok else self.model.config.eos_token_ids)


def replica_mesh(mesh: MeshConfig, replica: int, own_devices: bool = False) -> Mesh:
    """Replica `replica`'s device mesh.

    In a process that sees every replica's devices (one process running them all, or a CPU
    process forced to that many host devices), its slice of jax.devices() (mesh_config.py says
    which). With `own_devices`, a process started for this one replica (its engine-core process,
    with CUDA_VISIBLE_DEVICES naming its GPUs) that sees exactly `mesh.model` devices takes them.
    """
    devices = jax.devices()
    if own_devices and len(devices) < mesh.num_devices and len(devices) == mesh.model:
        return make_mesh(mesh.replica(), 0, devices)
    return make_mesh(mesh, replica, devices)


def tfrt_measured(config: EngineConfig, own_devices: bool) -> bool:
    """Whether the engine is of the kind measured under XLA's TFRT GPU client (gpu_client "auto"
    takes it only then): one device driven by this process (one replica of tensor parallelism 1,
    or one replica's own process), bf16 or float32 weights and pages."""
    if config.distributed.enabled or config.mesh.model > 1:
        return False
    if config.quantization is not None or config.kv_cache_dtype != "auto":
        return False
    return own_devices or config.mesh.num_replicas == 1


def build_engine(
    config: EngineConfig,
    replica: int = 0,
    *,
    own_devices: bool = False,
    tokenizer: Tokenizer | None = None,
    role: Role | None = None,
) -> EngineParts:
    """Load the model, size the KV pool, compile and warm every program, wire the core.

    With data-parallel replicas (`config.mesh.data > 1`), builds replica `replica` on its own
    devices (`replica_mesh`); `tokenizer`, when given, replaces the loaded one so that replicas
    of one process share theirs. A disaggregated mesh builds every replica and the KV mover
    between them (disaggregated.py), which builds each replica here with its `role` ("prefill":
    its scheduler hands each request off after its first token)."""
    xla_flags.apply(config.command_buffer_update)  # before any JAX call: XLA reads it once
    client = gpu_client.apply(config.gpu_client, measured=tfrt_measured(config, own_devices))
    multihost = config.distributed
    if multihost.enabled and config.mesh.num_replicas > 1:
        raise ValueError(
            f"mesh {config.mesh.describe()} on {multihost.num_processes} processes: a multi-host "
            "engine is one replica, tensor parallel over every process's devices"
        )
    if multihost.enabled and config.scheduler.num_scheduler_steps > 1:
        raise ValueError(
            f"num_scheduler_steps={config.scheduler.num_scheduler_steps}: multi-step decode is "
            "not available on a multi-host engine (its step broadcast carries one step)"
        )
    distributed.join(multihost)  # before any JAX computation; nothing in a single process
    if config.mesh.disaggregated and role is None:
        from nori_jax.disaggregated import build_disaggregated

        return build_disaggregated(config)
    started = time.perf_counter()
    cache_dir = compilation_cache.enable(config.compilation_cache_dir)
    logger.info("XLA compilation cache: %s", cache_dir)
    mesh = replica_mesh(config.mesh, replica, own_devices)
    if mesh.devices.flat[0].platform != "gpu":
        client = "none"  # the variable reaches only the CUDA plugin
    if multihost.enabled and config.mesh.num_devices != jax.device_count():
        raise ValueError(
            f"mesh {config.mesh.describe()} on {multihost.num_processes} processes: a multi-host "
            f"engine spans every process's devices, set the tensor parallel size to "
            f"{jax.device_count()} (all devices)"
        )
    attention_backend = resolve_attention_backend(config.attention_backend)
    attention_tuning = resolve_attention_tuning(
        config.attention_tuning,
        attention_backend,
        dtype=resolve_dtype(config.dtype),
        platform=mesh.devices.flat[0].platform,
    )
    page_size = config.scheduler.page_size
    if attention_backend == "pallas" and is_fp8(kv_page_dtype(config.kv_cache_dtype, jnp.float32)):
        if page_size < FP8_MIN_PAGE_SIZE:
            raise ValueError(
                f"page_size={page_size} with kv_cache_dtype={config.kv_cache_dtype!r}: the Pallas "
                f"attention kernel reads fp8 pages of {FP8_MIN_PAGE_SIZE} tokens and more "
                "(their V is stored transposed, pallas_kernels/kv_layout.py)"
            )
    start = time.perf_counter()
    model = load_model(
        config.model,
        dtype=config.dtype,
        load_format=config.load_format,
        mesh=mesh,
        attention_backend=attention_backend,
        seed=config.seed,
        tokenizer=config.tokenizer,
        # The orbax cache is per host and its writes are collective: not across processes.
        param_cache=config.param_cache and not multihost.enabled,
        quantization=config.quantization,
        small_matmul=resolve_quantized_matmul(config),
        attention_tuning=attention_tuning,
    )
    load_seconds = time.perf_counter() - start
    if tokenizer is not None:
        model.tokenizer = tokenizer
    mcfg = model.config
    config.mesh.check_model(mcfg)
    scfg = config.scheduler.for_model(mcfg.position_limit)
    page_size = scfg.page_size
    kv_dtype = kv_page_dtype(config.kv_cache_dtype, model.dtype)
    num_pages = config.num_pages or num_pages_for_memory(
        mcfg,
        page_size,
        kv_dtype,
        mesh,
        config.gpu_memory_utilization,
        config.cpu_kv_cache_gib,
        weight_bytes=model.weight_bytes,
    )
    if multihost.enabled:  # every process must allocate the same pool (free memory may differ)
        num_pages = distributed.agree_min("num_pages", num_pages, multihost)
    allocator = PageAllocator(num_pages, page_size, scfg.enable_prefix_caching)
    scheduler = Scheduler(scfg, allocator, hand_off=role == "prefill")
    builder = PlanBuilder(
        scfg.max_num_seqs,
        scfg.max_pages_per_seq,
        page_size,
        num_pages,
        scheduler.buckets,
        mcfg.vocab_size,
    )
    kv_scales = None
    if config.calculate_kv_scales:
        t0 = time.perf_counter()
        kv_scales = measure_kv_scales(model, mesh, kv_dtype, calibration_token_ids(model))
        logger.info(
            "KV scales calibrated in %.1fs: k %.3g-%.3g, v %.3g-%.3g over %d layers",
            time.perf_counter() - t0,
            kv_scales[:, 0].min(),
            kv_scales[:, 0].max(),
            kv_scales[:, 1].min(),
            kv_scales[:, 1].max(),
            len(kv_scales),
        )
    runner = ModelRunner(
        model,
        mesh,
        num_pages,
        page_size,
        builder.layout,
        scheduler.buckets,
        kv_dtype,
        kv_scales,
        num_scheduler_steps=scfg.num_scheduler_steps,
        multi_step_max_seqs=scfg.multi_step_max_seqs,
        stack_weights=config.stack_weights,
    )
    runner.compile_all()
    runner.warm_up()
    # Process 0 of a multi-host engine sends each step to the followers before launching it; a
    # follower's core stays idle (follower.py runs the steps process 0 sends).
    executor = (
        LeaderExecutor(runner, multihost) if multihost.enabled and multihost.is_leader else runner
    )
    core = EngineCore(
        scheduler, builder, CountedRunner(executor), async_scheduling=config.async_scheduling
    )
    logger.info(
        "engine%s ready in %.1fs: %s, %s (%.2f GiB), max_model_len %d, %d sequences, %d KV pages "
        "of %d tokens in %s, buckets %s, attention=%s%s%s",
        f" replica {replica} of {config.mesh.data}" if config.mesh.data > 1 else "",
        time.perf_counter() - started,
        model.source,
        model.describe_weights(),
        model.weight_bytes / 2**30,
        scfg.max_model_len,
        scfg.max_num_seqs,
        num_pages,
        page_size,
        jnp.dtype(kv_dtype).name,
        scheduler.buckets,
        attention_backend,
        f" ({format_overrides(attention_tuning)})" if attention_tuning else "",
        f", gpu client {client}" if client != "none" else "",
    )
    return EngineParts(config, core, model, runner, scfg, scfg.max_model_len, load_seconds, client)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        if not config.distributed.is_leader:
            raise ValueError(
                f"distributed process_id={config.distributed.process_id} is a follower: it runs "
                "nori_jax.follower.follow(config) (or `nori-jax serve/generate` with its "
                "--process-id), not an engine of its own"
            )
        # A disaggregated engine's core drives all its replicas (disaggregated.py).
        if config.mesh.num_replicas > 1 and not config.mesh.disaggregated:
            raise ValueError(
                f"mesh {config.mesh.describe()}: LLMEngine runs one replica; "
                "make_engine(config) builds the engine for several"
            )
        self._attach(config, build_engine(config))

    def _attach(self, config: EngineConfig, parts: EngineParts) -> None:
        """The frontend over a built engine (ReplicatedEngine: over replica 0's)."""
        self.config = config
        self.parts = parts
        self.core = parts.core
        self.model = parts.model
        self.runner = parts.runner
        self.tokenizer = parts.tokenizer
        self.max_model_len = parts.max_model_len
        self.scheduler_config = parts.scheduler_config
        self.load_seconds = parts.load_seconds
        self.processor = OutputProcessor(self.tokenizer)
        self.metrics = EngineMetrics()
        self.metrics.set_model_config(parts.config_info)
        self._rng = np.random.default_rng(config.seed)
        self._next_id = 0
        self._eos = parts.eos_token_ids
        # update_weights / sleep / wake_up (weight_control.py), on every replica's parts.
        self.weight_control = WeightControl(
            self._parts_to_update,
            self.has_unfinished_requests,
            self.drain,
            swap_refusal(config),
            self.metrics,
        )

    # ---- parts ------------------------------------------------------------------------------

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def step_times(self):
        return self.core.step_times

    @property
    def step_shapes(self) -> StepShapes:
        """Steps and their wall time by token bucket and kind (core/step_shapes.py)."""
        return self.core.step_shapes

    @property
    def num_recompiles(self) -> int:
        """XLA programs built inside this engine's steps since warm-up; anything but 0 is a bug."""
        return self.core.num_recompiles

    # ---- requests ---------------------------------------------------------------------------

    def new_request_id(self) -> str:
        """A request id no live request holds (a caller's own ids may look like these)."""
        while True:
            self._next_id += 1
            request_id = f"req-{self._next_id - 1}"
            if request_id not in self.processor:
                return request_id

    def tokenize(self, prompt: str | list[int]) -> tuple[list[int], str | None]:
        """Validate a prompt and return (token ids, text or None)."""
        return encode_prompt(
            self.tokenizer, prompt, self.model.config.vocab_size, self.max_model_len
        )

    def add_request(
        self,
        request_id: str | None,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        tokenized: tuple[list[int], str | None] | None = None,
        stream: bool = True,
        priority: int = 0,
    ) -> str:
        """Queue a request; ValueError for bad input, QueueFullError when the queue is full.

        `tokenized` is `self.tokenize(prompt)` when the caller already ran it (batch validation).
        With `stream`, each step returns an output for the request when it has new tokens;
        otherwise only its finished output comes back (no per-step text). `priority`: under the
        scheduling policy "priority", lower runs first (0 under "fcfs").
        """
        self.weight_control.check_awake("add_request")
        params = params or SamplingParams()
        params.validate()
        check_priority(priority, self.scheduler_config.scheduling_policy)
        token_ids, text = tokenized or self.tokenize(prompt)
        request_id = request_id or self.new_request_id()
        seed = params.seed if params.seed is not None else int(self._rng.integers(0, 2**31))
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        # The core is in this process: its finish brings the whole output, so the processor
        # need not collect a final-only request's tokens step by step.
        self._submit(
            EngineCoreRequest(
                request_id,
                token_ids,
                params,
                seed,
                self._eos,
                arrival,
                final_token_ids=True,
                priority=priority,
            )
        )
        self.processor.add(
            request_id, text, token_ids, params, tuple(self._eos), stream, final_ids_from_core=True
        )
        return request_id

    def _submit(self, request: EngineCoreRequest) -> None:
        """Hand a validated request to the core (ReplicatedEngine: to the replica it routes to)."""
        self.core.add_request(request)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Finish a request now (reason "abort"); its pages return to the pool at once."""
        finished = self.core.abort(request_id)
        if finished is None:
            return None
        self.metrics.observe_finished(finished)
        return self.processor.finish(finished)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished()

    # ---- the loop ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one engine iteration; return an output for every streamed request that gained
        tokens and for every request that finished (see EngineCore.step)."""
        return self._process(self.core.step())

    def drain(self) -> list[RequestOutput]:
        """Wait for the step still in flight, if any, and deliver its samples."""
        return self._process(self.core.drain())

    def update_weights(self, tensors: Tensors) -> None:
        """Serve with new weights from the next request on (weights/update.py): Hugging Face-named
        tensors (a mapping or (name, array) pairs, host or device arrays) for every parameter,
        fused, quantized and placed as loading a checkpoint would, one tensor at a time. No
        recompilation; the prefix cache is emptied (its KV came from the old weights). Only
        between requests: EngineBusyError (a ValueError) while any is queued or running,
        ValueError for a tensor the model does not take (the weights are then unchanged)."""
        self.weight_control.update_weights(tensors)

    def sleep(self, level: int = 1) -> None:
        """Give the device's memory back until `wake_up` (a trainer on the same GPU between
        rollouts; weights/residency.py): the KV pages and the step's buffers are freed and the
        prefix cache emptied; the weights move to pinned host memory (level 1) or are dropped
        (level 2: `wake_up(weights=...)` brings new ones). The compiled programs stay, so waking
        up compiles nothing. Only between requests; requests are refused while asleep."""
        self.weight_control.sleep(level)

    def wake_up(self, weights: Tensors | None = None) -> None:
        """Back on the device after `sleep`: the kept weights, or `weights` (every parameter,
        Hugging Face-named, as `update_weights` takes them; checked on the host first, then
        placed straight on the device, the kept ones never moved back), fresh KV pages."""
        self.weight_control.wake_up(weights)

    @property
    def is_sleeping(self) -> bool:
        return self.weight_control.asleep

    def _parts_to_update(self) -> list[EngineParts]:
        """The engines whose weights an update replaces (ReplicatedEngine: every replica's)."""
        return [self.parts]

    def _process(self, outs: EngineCoreOutputs) -> list[RequestOutput]:
        outputs, ended = self.processor.process(outs)
        for request_id, reason in ended.items():  # stop strings, errors: the core finishes them
            finished = self.core.abort(request_id, reason)
            if finished is not None:
                outs.finished.append(finished)
                outputs.append(self.processor.finish(finished))
        self.metrics.observe(outs)
        return outputs

    def get_metrics(self) -> dict:
        return self.metrics.as_dict()
