"""LLMEngine: add_request / step / abort over scheduler -> runner -> scheduler.update.

Single-threaded and synchronous: the offline `LLM` drives it in a loop and the server's engine
thread does the same. Everything that touches JAX happens inside `step()` (and construction).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time

import jax
import numpy as np

from nori_jax import compilation_cache, compile_counter
from nori_jax.engine_config import EngineConfig
from nori_jax.kv_cache import num_pages_for_memory
from nori_jax.mesh import make_mesh
from nori_jax.metrics import EngineMetrics
from nori_jax.output_processor import OutputProcessor
from nori_jax.outputs import RequestOutput
from nori_jax.paging import PageAllocator
from nori_jax.request import Request, RequestTimes
from nori_jax.runner import ModelRunner
from nori_jax.sampling_params import SamplingParams
from nori_jax.scheduler import Scheduler
from nori_jax.weights.loader import load_model
from pallas_kernels.ragged_paged_attention.api import BACKENDS

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class StepTimes:
    """Cumulative host wall time of the engine loop, split by stage (seconds)."""

    steps: int = 0
    tokens: int = 0  # real (unpadded) tokens run through the model
    padded_tokens: int = 0  # tokens of the compiled buckets actually executed
    schedule: float = 0.0  # Scheduler.schedule(): picking work and building the StepPlan
    launch: float = 0.0  # host-to-device transfer of the plan and dispatch of the step
    wait: float = 0.0  # blocked on the device for a step's tokens (host idle)
    postprocess: float = 0.0  # Scheduler.update(), detokenization, stop strings, metrics


def resolve_attention_backend(name: str) -> str:
    """'auto' is the Pallas kernel on GPU when it is built, the jnp reference elsewhere."""
    if name != "auto":
        if name not in BACKENDS:
            raise ValueError(f"attention_backend={name!r} is not available; built: {BACKENDS}")
        return name
    return "pallas" if jax.default_backend() == "gpu" and "pallas" in BACKENDS else "reference"


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        started = time.perf_counter()
        cache_dir = compilation_cache.enable(config.compilation_cache_dir)
        logger.info("XLA compilation cache: %s", cache_dir)
        self.mesh = make_mesh(config.mesh)
        self.attention_backend = resolve_attention_backend(config.attention_backend)
        start = time.perf_counter()
        self.model = load_model(
            config.model,
            dtype=config.dtype,
            load_format=config.load_format,
            mesh=self.mesh,
            attention_backend=self.attention_backend,
            seed=config.seed,
            tokenizer=config.tokenizer,
            param_cache=config.param_cache,
        )
        self.load_seconds = time.perf_counter() - start
        mcfg = self.model.config
        config.mesh.check_model(mcfg)
        self.tokenizer = self.model.tokenizer
        self.scheduler_config = config.scheduler.for_model(mcfg.position_limit)
        self.max_model_len = self.scheduler_config.max_model_len
        page_size = self.scheduler_config.page_size
        num_pages = config.num_pages or num_pages_for_memory(
            mcfg,
            page_size,
            self.model.dtype,
            self.mesh,
            config.gpu_memory_utilization,
            config.cpu_kv_cache_gib,
        )
        allocator = PageAllocator(num_pages, page_size, self.scheduler_config.enable_prefix_caching)
        self.scheduler = Scheduler(self.scheduler_config, allocator)
        self.runner = ModelRunner(
            self.model,
            self.mesh,
            num_pages,
            page_size,
            self.scheduler_config.max_num_seqs,
            self.scheduler_config.max_pages_per_seq,
            self.scheduler.buckets,
        )
        self.runner.compile_all()
        self.runner.warm_up()
        self.processor = OutputProcessor(self.tokenizer)
        self.metrics = EngineMetrics()
        self._rng = np.random.default_rng(config.seed)
        self._ids = itertools.count()
        self._eos = tuple(self.tokenizer.eos_token_ids if self.tokenizer else mcfg.eos_token_ids)
        self._num_recompiles = self._recompiles_seen = 0
        self.step_times = StepTimes()
        self._in_flight = None  # (plan, device handle) launched but not yet fetched
        self._preemptions_seen = self._hits_seen = self._queries_seen = 0
        logger.info(
            "engine ready in %.1fs: %s, %s, max_model_len %d, %d sequences, %d KV pages of %d "
            "tokens, buckets %s, attention=%s",
            time.perf_counter() - started,
            self.model.source,
            self.model.dtype.__name__
            if hasattr(self.model.dtype, "__name__")
            else self.model.dtype,
            self.max_model_len,
            self.scheduler_config.max_num_seqs,
            num_pages,
            page_size,
            self.scheduler.buckets,
            self.attention_backend,
        )

    # ---- requests ---------------------------------------------------------------------------

    @property
    def num_recompiles(self) -> int:
        """XLA programs built inside this engine's steps since warm-up; anything but 0 is a bug."""
        return self._num_recompiles

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def tokenize(self, prompt: str | list[int]) -> tuple[list[int], str | None]:
        """Validate a prompt and return (token ids, text or None)."""
        token_ids, text = self._encode(prompt)
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens; max_model_len={self.max_model_len} leaves no "
                f"room to generate"
            )
        return token_ids, text

    def _encode(self, prompt: str | list[int]) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as lists of token ids")
            return self.tokenizer.encode(prompt), prompt
        if not isinstance(prompt, (list, tuple)) or not all(
            isinstance(t, (int, np.integer)) for t in prompt
        ):
            raise ValueError(
                f"prompt must be a string or a list of token ids, got {type(prompt).__name__}"
            )
        if not prompt:
            raise ValueError("prompt is empty (no token ids)")
        vocab = self.model.config.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        return [int(t) for t in prompt], None

    def add_request(
        self,
        request_id: str | None,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        tokenized: tuple[list[int], str | None] | None = None,
    ) -> str:
        """Queue a request; ValueError for bad input, QueueFullError when the queue is full.

        `tokenized` is `self.tokenize(prompt)` when the caller already ran it (batch validation).
        """
        params = params or SamplingParams()
        params.validate()
        token_ids, text = tokenized or self.tokenize(prompt)
        seed = params.seed if params.seed is not None else int(self._rng.integers(0, 2**31))
        req = Request(
            request_id=request_id or self.new_request_id(),
            prompt_token_ids=token_ids,
            params=params,
            seed=seed,
            eos_token_ids=self._eos,
            times=RequestTimes(arrival_time if arrival_time is not None else time.monotonic()),
        )
        self.scheduler.add_request(req)
        self.processor.add(req, text)
        return req.request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        """Finish a request now (reason "abort"); its pages return to the pool at once."""
        req = self.scheduler.finish_request(request_id, "abort")
        if req is None:
            return None
        self.metrics.observe_finished(req)
        return self.processor.output(req)

    def has_unfinished_requests(self) -> bool:
        # A step still in flight once every request has finished holds only rows of finished
        # requests (planned before their end was known): its samples are discarded unseen.
        return self.scheduler.has_unfinished()

    # ---- the loop ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one engine iteration; return an output for every request that gained tokens or
        finished.

        With `async_scheduling` (the default) the step launched here is fetched by the next call:
        the host schedules step N+1 and post-processes step N-1 while the device runs step N, so
        outputs trail the device by one step. Without it, each call launches and fetches its step.
        """
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        t1 = time.perf_counter()
        launched = None
        if plan is not None:
            compiles_before = compile_counter.compile_count()
            launched = (plan, self.runner.launch(plan))
            self._num_recompiles += compile_counter.compile_count() - compiles_before
        t2 = time.perf_counter()
        if self.config.async_scheduling:
            done, self._in_flight = self._in_flight, launched
        else:
            done = launched
        outputs: list[RequestOutput] = []
        t3 = t4 = t2
        if done is not None:
            tokens, logprobs = self.runner.fetch(done[1])
            t3 = time.perf_counter()
            outputs = self._deliver(done[0], tokens, logprobs)
            t4 = time.perf_counter()
        st = self.step_times
        if plan is not None:
            st.steps += 1
            st.tokens += plan.num_tokens
            st.padded_tokens += plan.bucket
            self.metrics.scheduler_duration.observe(t1 - t0)
        if plan is not None or done is not None:
            self.metrics.step_duration.observe(t4 - t0)
        st.schedule += t1 - t0
        st.launch += t2 - t1
        st.wait += t3 - t2
        st.postprocess += t4 - t3
        self._update_gauges()
        return outputs

    def drain(self) -> list[RequestOutput]:
        """Wait for the step still in flight, if any, and deliver its samples.

        Call when going idle: once every request has finished, that step only holds rows planned
        before their end was known, and nothing should be left running on the device when the
        process exits.
        """
        done, self._in_flight = self._in_flight, None
        if done is None:
            return []
        return self._deliver(done[0], *self.runner.fetch(done[1]))

    def _deliver(self, plan, tokens: np.ndarray, logprobs: np.ndarray) -> list[RequestOutput]:
        """Hand a finished step's samples to the scheduler, then detokenize and report."""
        outputs = []
        for req in self.scheduler.update(plan, tokens, logprobs):
            if self.processor.detokenize(req):
                self.scheduler.finish_request(req.request_id, "stop")
            if len(req.output_token_ids) == 1 and req.times.first_token is not None:
                self.metrics.ttft.observe(req.times.first_token - req.times.arrival)
            self.metrics.generation_tokens.inc()
            if req.is_finished:
                self.metrics.observe_finished(req)
            outputs.append(self.processor.output(req))
        return outputs

    def _update_gauges(self) -> None:
        m, s = self.metrics, self.scheduler
        m.running.set(len(s.running))
        m.waiting.set(s.num_waiting)
        m.kv_usage.set(s.allocator.usage)
        c = s.counters
        m.preemptions.inc(c.num_preemptions - self._preemptions_seen)
        m.prefix_hits.inc(c.prefix_cache_hits - self._hits_seen)
        m.prefix_queries.inc(c.prefix_cache_queries - self._queries_seen)
        self._preemptions_seen, self._hits_seen = c.num_preemptions, c.prefix_cache_hits
        self._queries_seen = c.prefix_cache_queries
        m.recompiles.inc(self._num_recompiles - self._recompiles_seen)
        self._recompiles_seen = self._num_recompiles

    def get_metrics(self) -> dict:
        self._update_gauges()
        return self.metrics.as_dict()
