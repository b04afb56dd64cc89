"""The engine core: the step loop over scheduler -> plan builder -> executor -> scheduler.update.

JAX-free: the executor (executor/runner.py on a device, a fake in tests and host benchmarks) is
the only part that touches JAX. Requests arrive already tokenized and validated
(`EngineCoreRequest`); each step returns raw, columnar `EngineCoreOutputs`. Detokenization, stop
strings and user-facing outputs belong to the output processor, in the caller's process.

With `async_scheduling` (the default) the step launched by one call is fetched by the next: the
host schedules and builds step N+1, launches it, then post-processes step N while the device runs
N+1, so outputs trail the device by one step.

No request can take the loop down with it. `add_request` vets each request against what the
core's arrays hold (a copy of its settings, so a caller changing them later changes nothing here),
and a request's settings enter the step's arrays at one point, its slot's `Acquire` event: an
exception there finishes that request alone (finish reason "error", with the error's text) and
the step goes on. An exception anywhere else in a step is the engine's, not a request's, and
propagates: the frontend treats the engine as dead (the server restarts the engine-core process).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Protocol

import msgspec
import numpy as np

from nori_jax.core.outputs import (
    EngineCoreOutputs,
    FinishedRequest,
    FirstToken,
    RequestMetrics,
    StepStats,
)
from nori_jax.core.plan_builder import PlanBuilder
from nori_jax.core.request import Request, RequestTimes
from nori_jax.core.scheduler import Scheduler, StepUpdate
from nori_jax.core.scheduler_output import Acquire, SchedulerOutput
from nori_jax.core.step_plan import StepPlan
from nori_jax.core.step_shapes import StepShape, StepShapes, step_kind
from nori_jax.sampling_params import INT32_MAX, ParameterError, SamplingParams


class Executor(Protocol):
    num_recompiles: int  # programs built after warm-up; anything but 0 is a bug

    def launch(self, plan: StepPlan) -> Any: ...

    def fetch(self, handle: Any) -> tuple[np.ndarray, np.ndarray]: ...


class EngineCoreRequest(msgspec.Struct, array_like=True, gc=False):
    """A validated, tokenized request, as the frontend hands it to the engine core."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # the sampling seed actually used (params.seed or one drawn by the frontend)
    eos_token_ids: list[int]
    arrival_time: float  # time.monotonic() (one clock for every process of a host)
    # Its FinishedRequest carries its whole output (`FinishedRequest.token_ids`): asked by a
    # frontend in this process (LLMEngine), whose output processor then skips a final-only
    # request's tokens step by step (the scheduler keeps them all anyway). The API servers'
    # client leaves it off: they get every token in the step outputs, over the socket.
    final_token_ids: bool = False
    # Under the scheduling policy "priority": lower runs first, and is preempted last.
    priority: int = 0


@dataclasses.dataclass(frozen=True)
class Launched:
    """A step on the device: its rows, the executor's handle, its shape and when it was
    launched (perf_counter after the dispatch)."""

    scheduled: SchedulerOutput
    handle: Any
    shape: StepShape
    tokens: int
    at: float


@dataclasses.dataclass
class PendingStep:
    """A step between `launch_step` and `complete_step`."""

    launched: Launched | None  # the step launched now (None: nothing to run)
    done: Launched | None  # the step to fetch now
    failed: list[FinishedRequest]  # requests whose admission failed this step
    t0: float  # perf_counter at the start of scheduling
    t1: float  # after building the plan
    t2: float  # after the launch


@dataclasses.dataclass
class StepTimes:
    """Cumulative host wall time of the engine loop, split by stage (seconds)."""

    steps: int = 0
    tokens: int = 0  # real (unpadded) tokens run through the model
    padded_tokens: int = 0  # tokens of the compiled buckets actually executed
    multi_step_launches: int = 0  # of `steps`, launches of several decode steps
    schedule: float = 0.0  # Scheduler.schedule() and building the step's buffers
    launch: float = 0.0  # host-to-device transfer of the buffers and dispatch of the step
    wait: float = 0.0  # blocked on the device for a step's tokens (host idle)
    postprocess: float = 0.0  # Scheduler.update() and the step's outputs


def request_metrics(req: Request) -> RequestMetrics:
    t = req.times
    return RequestMetrics(
        t.queue_time,
        t.prefill_time,
        t.decode_time,
        None if t.first_token is None else t.first_token - t.arrival,
        None if t.finished is None else t.finished - t.arrival,
        req.num_preemptions,
        req.num_cached_tokens,
    )


def finished_request(req: Request, error: str | None = None) -> FinishedRequest:
    return FinishedRequest(
        req.request_id,
        req.finish_reason or "abort",
        req.num_prompt_tokens,
        len(req.output_token_ids),
        request_metrics(req),
        error,
        list(req.output_token_ids) if req.final_token_ids else None,
    )


def vetted_params(r: EngineCoreRequest, vocab_size: int, max_model_len: int) -> SamplingParams:
    """A validated copy of the request's settings; ParameterError for anything the engine's arrays
    cannot hold (the frontends check the same, this is the core's own boundary)."""
    ids = r.prompt_token_ids
    if not 0 < len(ids) < max_model_len:
        raise ParameterError(
            "prompt", f"prompt has {len(ids)} tokens; it must have 1 to {max_model_len - 1}"
        )
    arr = np.asarray(ids)
    if arr.dtype.kind not in "iu" or arr.min() < 0 or arr.max() >= vocab_size:
        raise ParameterError("prompt", f"prompt token ids must be in [0, {vocab_size})")
    if not 0 <= r.seed <= INT32_MAX:
        raise ParameterError("seed", f"seed={r.seed} must be in [0, 2**31)")
    params = dataclasses.replace(r.params)  # runs validate(); copies the stop lists
    params.check_vocab(vocab_size)
    if params.n != 1:
        raise ParameterError(
            "n",
            f"n={params.n}: a request is one sample; the frontends (LLM.generate, the server's "
            "`n`) queue n requests (sampling_params.sample_choices)",
        )
    return params


def check_priority(priority: object, policy: str) -> None:
    """ParameterError unless `priority` is an int32 the policy takes (any under "priority", 0
    under "fcfs", as vLLM refuses a priority it would ignore)."""
    if (
        not isinstance(priority, int)
        or isinstance(priority, bool)
        or not (-INT32_MAX - 1 <= priority <= INT32_MAX)
    ):
        raise ParameterError("priority", f"priority={priority!r:.50} must be a 32-bit integer")
    if priority and policy != "priority":
        raise ParameterError(
            "priority",
            f"priority={priority} needs the engine's scheduling_policy='priority' (it is "
            f"{policy!r})",
        )


class EngineCore:
    def __init__(
        self,
        scheduler: Scheduler,
        builder: PlanBuilder,
        executor: Executor,
        *,
        async_scheduling: bool = True,
    ):
        self.scheduler = scheduler
        self.builder = builder
        self.executor = executor
        self.async_scheduling = async_scheduling
        self.step_times = StepTimes()
        self.step_shapes = StepShapes()  # wall time per step by its shape (step_shapes.py)
        self._last_fetch: float | None = None
        self._fetched: list[tuple[int, str, float]] = []  # for the next StepStats
        self._in_flight: Launched | None = None
        self._seen = (0, 0, 0, 0)  # preemptions, prefix hits, prefix queries, recompiles

    # ---- requests ---------------------------------------------------------------------------

    def add_request(self, r: EngineCoreRequest) -> None:
        """Queue a request; ParameterError for settings the engine cannot hold, ValueError for a
        duplicate id, QueueFullError when the queue is full."""
        params = vetted_params(r, self.builder.vocab_size, self.scheduler.config.max_model_len)
        check_priority(r.priority, self.scheduler.config.scheduling_policy)
        if params.prompt_logprobs is not None and self.scheduler.config.max_num_seqs < 2:
            raise ParameterError(
                "prompt_logprobs",
                "prompt_logprobs needs max_num_seqs >= 2: each scored prompt position takes a "
                "logit row the step's own rows leave free",
            )
        self.scheduler.add_request(
            Request(
                request_id=r.request_id,
                prompt_token_ids=list(r.prompt_token_ids),
                params=params,
                seed=r.seed,
                eos_token_ids=tuple(r.eos_token_ids),
                times=RequestTimes(r.arrival_time),
                final_token_ids=r.final_token_ids,
                priority=r.priority,
            )
        )

    def abort(self, request_id: str, reason: str = "abort") -> FinishedRequest | None:
        """Finish a request now; its pages return to the pool at once. None if unknown."""
        req = self.scheduler.finish_request(request_id, reason)
        return None if req is None else finished_request(req)

    @property
    def num_recompiles(self) -> int:
        """Programs the executor built after warm-up; anything but 0 is a bug."""
        return self.executor.num_recompiles

    @property
    def has_in_flight(self) -> bool:
        """A launched step has not been fetched yet (see `drain`)."""
        return self._in_flight is not None

    def has_unfinished(self) -> bool:
        # A step still in flight once every request has finished holds only rows of finished
        # requests (planned before their end was known): its samples are discarded unseen.
        return self.scheduler.has_unfinished()

    # ---- the loop ---------------------------------------------------------------------------

    def step(self) -> EngineCoreOutputs:
        """Run one engine iteration; return the tokens it delivered and who finished."""
        return self.complete_step(self.launch_step())

    def launch_step(self) -> PendingStep:
        """The first half of `step`: schedule, build and launch the next step, without waiting
        for the device. Several cores (data-parallel replicas) launch before any completes, so
        their devices run together."""
        t0 = time.perf_counter()
        scheduled = self.scheduler.schedule()
        failed: list[FinishedRequest] = []
        plan = None
        if scheduled is not None:
            failed = self._apply_batch_events(scheduled)
            plan = self.builder.build(scheduled)
        t1 = time.perf_counter()
        launched = None
        if plan is not None:
            handle = self.executor.launch(plan)
            launched = Launched(scheduled, handle, _shape(plan), _tokens(plan), time.perf_counter())
        t2 = time.perf_counter()
        if self.async_scheduling:
            done, self._in_flight = self._in_flight, launched
        else:
            done = launched
        return PendingStep(launched, done, failed, t0, t1, t2)

    def complete_step(self, pending: PendingStep) -> EngineCoreOutputs:
        """The second half of `step`: fetch the step due now and turn it into outputs."""
        launched, done = pending.launched, pending.done
        t0, t1, t2 = pending.t0, pending.t1, pending.t2
        t3 = t4 = t2
        out = EngineCoreOutputs.empty()
        if done is not None:
            samples = self._fetch(done)  # tokens, logprobs[, top logprobs]
            t3 = time.perf_counter()
            out = self._outputs(self.scheduler.update(done.scheduled, *samples))
            t4 = time.perf_counter()
        out.finished.extend(pending.failed)
        st = self.step_times
        if launched is not None:
            shape = launched.shape
            st.steps += 1
            st.tokens += launched.tokens
            st.multi_step_launches += launched.scheduled.decode_steps is not None
            st.padded_tokens += shape.bucket * shape.num_steps
        st.schedule += t1 - t0
        st.launch += t2 - t1
        st.wait += t3 - t2
        st.postprocess += t4 - t3
        step_s = t4 - t0 if (launched is not None or done is not None) else 0.0
        out.stats = self._stats(len(out.request_ids), t1 - t0, step_s, int(launched is not None))
        return out

    def drain(self) -> EngineCoreOutputs:
        """Wait for the step still in flight, if any, and deliver its samples.

        Call when going idle: once every request has finished, that step only holds rows planned
        before their end was known, and nothing should be left running on the device.
        """
        done, self._in_flight = self._in_flight, None
        if done is None:
            out = EngineCoreOutputs.empty()
        else:
            out = self._outputs(self.scheduler.update(done.scheduled, *self._fetch(done)))
        out.stats = self._stats(len(out.request_ids), 0.0, 0.0, 0)
        return out

    def _fetch(self, done: Launched) -> tuple:
        """The step's samples, its wall time observed in `step_shapes` (step_shapes.py: from
        the previous fetch, or from its launch if that came later)."""
        samples = self.executor.fetch(done.handle)
        now = time.perf_counter()
        last, self._last_fetch = self._last_fetch, now
        start = done.at if last is None else max(last, done.at)
        self.step_shapes.observe(done.shape, done.tokens, now - start)
        self._fetched.append((done.shape.bucket, done.shape.kind, now - start))
        return samples

    def _apply_batch_events(self, scheduled: SchedulerOutput) -> list[FinishedRequest]:
        """Hand the step's batch events to the plan builder one by one. An admission whose settings
        the builder cannot write finishes that request ("error"); its row in this step computes
        into pages it no longer owns and its sample is discarded, as for any request finished
        between planning and fetching a step."""
        events, scheduled.events = scheduled.events, []
        failed = []
        for ev in events:
            try:
                self.builder.apply([ev])
            except Exception as e:
                req = self.scheduler.slots.requests[ev.slot] if isinstance(ev, Acquire) else None
                if req is None or req.pages != ev.pages:
                    raise  # not a request's settings: the engine's own fault
                error = f"{type(e).__name__}: {e}"
                failed.append(
                    finished_request(self.scheduler.finish_request(req.request_id, "error"), error)
                )
        return failed

    def _outputs(self, upd: StepUpdate) -> EngineCoreOutputs:
        return EngineCoreOutputs(
            upd.request_ids,
            upd.token_ids.astype(np.int32).tobytes(),
            b"" if upd.logprobs is None else upd.logprobs.astype(np.float32).tobytes(),
            [finished_request(r) for r in upd.finished],
            [
                FirstToken(r.request_id, r.times.first_token - r.times.arrival)
                for r in upd.first_tokens
            ],
            top_logprobs=upd.top_logprobs,
            prompt_logprobs=upd.prompt_logprobs,
        )

    def _stats(self, num_tokens: int, schedule_s: float, step_s: float, steps: int) -> StepStats:
        s, c = self.scheduler, self.scheduler.counters
        now = (
            c.num_preemptions,
            c.prefix_cache_hits,
            c.prefix_cache_queries,
            self.executor.num_recompiles,
        )
        delta = [a - b for a, b in zip(now, self._seen, strict=True)]
        self._seen = now
        return StepStats(
            num_running=len(s.running),
            num_waiting=s.num_waiting,
            kv_usage=s.allocator.usage,
            num_generated_tokens=num_tokens,
            num_preemptions=delta[0],
            prefix_cache_hits=delta[1],
            prefix_cache_queries=delta[2],
            num_recompiles=delta[3],
            schedule_seconds=schedule_s,
            step_seconds=step_s,
            num_steps=steps,
            launches=self._take_fetched(),
        )

    def _take_fetched(self) -> list[tuple[int, str, float]]:
        fetched, self._fetched = self._fetched, []
        return fetched


def _shape(plan: StepPlan) -> StepShape:
    s = plan.scheduled
    return StepShape(plan.bucket, step_kind(s.num_decodes, len(s.prefills)), plan.num_steps)


def _tokens(plan: StepPlan) -> int:
    """Real tokens the launch runs (every step of a multi-step launch)."""
    multi = plan.scheduled.decode_steps
    return plan.num_tokens if multi is None else int(multi.sum())
