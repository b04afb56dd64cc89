"""The engine core in simulated time: the real scheduler and plan builder over a simulated device.

`simulate` runs `EngineCore` (the same Scheduler, PageAllocator and PlanBuilder the engine runs:
continuous batching, chunked prefill, prefix caching, preemption, admission) with an executor
that computes nothing (`virtual_device.py`): `launch` advances a virtual clock by the host's cost
of scheduling and launching the step (and by the share `launch_wait` of the device's remaining
work on the step before, which the launch waits out) and puts the step on a virtual device that
runs steps in order, each for the step model's device time; `fetch` waits for the device in
virtual time and adds the post-processing cost. With overlapped scheduling (the engine's default)
the core launches step N+1 before fetching step N, so host and device overlap as the loop orders
them.

The loop is the engine-core process's (`engine_core_process._serve`): requests that have arrived
by the clock are added between steps, an idle core jumps to the next arrival, and a core with
nothing left but a launched step drains it. A token reaches the client when its step is fetched
and post-processed (plus the optional frontend stage below), which gives each request's TTFT,
inter-token gaps and E2E; `nori_jax.bench.metrics.compute_metrics` turns them into the numbers
`bench serve` reports. Outputs have the workload's lengths (`ignore_eos`, as the measured runs).

The frontend stage models the API server processes (detokenization, SSE, HTTP writes): `servers`
FIFO servers behind the core (`--api-server-count`), request i on server i mod `servers` (the
kernel spreads connections over the processes sharing the port), each taking
`step_s + token_s * tokens` of every step's output that holds tokens of its requests (the core
sends each API server its own requests' tokens), plus a fixed `latency_s` per token for the
way in and out (HTTP, the sockets); 0 costs (the default) leave it out. With `request_s` a
request also takes its server that long when it arrives (parsing, validation, tokenization, the
way to the core), in the same FIFO as the tokens, and reaches the core only then.

`core_io` (core_io.py) is the engine-core process's own send path after each step (splitting
the outputs by API server, encoding, ZeroMQ): host time on the core's clock, before the step's
tokens leave it.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from nori_jax.bench.client import RequestResult
from nori_jax.bench.metrics import compute_metrics
from nori_jax.bench.run import RunResult
from nori_jax.core.engine_core import EngineCore, EngineCoreRequest
from nori_jax.core.paging import PageAllocator
from nori_jax.core.plan_builder import PlanBuilder
from nori_jax.core.scheduler import QueueFullError, Scheduler
from nori_jax.core.scheduler_config import SchedulerConfig
from nori_jax.plan.core_io import NO_CORE_IO, CoreIO
from nori_jax.plan.features import StepFeatures
from nori_jax.plan.step_model import StepCosts
from nori_jax.plan.virtual_device import SimClock, SimExecutor
from nori_jax.sampling_params import SamplingParams

QUEUE_FULL = "queue full (the server's 429)"


@dataclasses.dataclass(frozen=True)
class SimEngine:
    """The engine simulated: its scheduler limits, KV pool and loop mode."""

    scheduler: SchedulerConfig
    num_pages: int  # KV pages, the null page included
    vocab_size: int
    async_scheduling: bool = True

    def __post_init__(self) -> None:
        if self.num_pages < 2:
            raise ValueError(f"num_pages={self.num_pages} must be >= 2 (page 0 is reserved)")
        if self.vocab_size < 32:
            raise ValueError(f"vocab_size={self.vocab_size} must be >= 32")


@dataclasses.dataclass(frozen=True)
class Frontend:
    step_s: float = 0.0
    token_s: float = 0.0
    servers: int = 1  # API server processes, each a FIFO of its own requests' outputs
    # The path outside the engine that no FIFO models: HTTP in, the request's way to the core,
    # and each token's way back out to the client; added to every token's time. Measured as the
    # client's mean TTFT less the engine's (bench serve's server_mean_ttft_ms).
    latency_s: float = 0.0
    # A request's own cost to its API server on arrival, before the core sees it.
    request_s: float = 0.0

    def __post_init__(self) -> None:
        for name, flag in (
            ("step_s", "--frontend-ms-per-step"),
            ("token_s", "--frontend-us-per-token"),
            ("latency_s", "--frontend-latency-ms"),
            ("request_s", "--frontend-ms-per-request"),
        ):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"frontend {name} ({flag}) must be finite and >= 0, got {v}")
        if self.servers < 1:
            raise ValueError(f"frontend servers must be >= 1, got {self.servers}")

    def deliver(self, t: float, request_ids: Sequence[str], free: list[float]) -> list[float]:
        """When each of one step's tokens (the core done with it at `t`) leaves its API server;
        `free[k]`, when server k is next idle, is advanced."""
        n = self.servers
        counts = [0] * n
        for rid in request_ids:
            counts[int(rid) % n] += 1
        for k, c in enumerate(counts):
            if c:
                free[k] = max(t, free[k]) + self.step_s + self.token_s * c
        return [free[int(rid) % n] + self.latency_s for rid in request_ids]

    def admit(self, index: int, arrival_s: float, free: list[float]) -> float:
        """When request `index`, arrived at `arrival_s`, reaches the core: after its server has
        done what was queued before it and its own `request_s`."""
        k = index % self.servers
        free[k] = max(arrival_s, free[k]) + self.request_s
        return free[k]

    @property
    def enabled(self) -> bool:
        return self.step_s > 0 or self.token_s > 0 or self.latency_s > 0 or self.request_s > 0


NO_FRONTEND = Frontend()


@dataclasses.dataclass(frozen=True)
class SimRequest:
    prompt: list[int]
    output_len: int
    arrival_s: float


@dataclasses.dataclass
class SimStats:
    """What the simulated engine did."""

    steps: int = 0
    simulated_s: float = 0.0  # the clock at the end
    device_busy_s: float = 0.0
    host_busy_s: float = 0.0
    num_preemptions: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_queries: int = 0
    rejected: int = 0
    steps_beyond_calibration: int = 0
    tokens: int = 0
    padded_tokens: int = 0
    # Per engine iteration: the clock after it, and requests running + waiting in the core.
    times: list[float] = dataclasses.field(default_factory=list)
    in_core: list[int] = dataclasses.field(default_factory=list)

    def summary(self) -> dict[str, float | int]:
        span = max(self.simulated_s, 1e-12)
        return {
            "steps": self.steps,
            "simulated_s": self.simulated_s,
            "device_busy_fraction": self.device_busy_s / span,
            "host_busy_fraction": self.host_busy_s / span,
            "mean_device_ms_per_step": 1e3 * self.device_busy_s / max(self.steps, 1),
            "mean_tokens_per_step": self.tokens / max(self.steps, 1),
            "padding_fraction": 1 - self.tokens / max(self.padded_tokens, 1),
            "num_preemptions": self.num_preemptions,
            "prefix_cache_hit_rate": self.prefix_cache_hits / max(self.prefix_cache_queries, 1),
            "rejected": self.rejected,
            "steps_beyond_calibration": self.steps_beyond_calibration,
        }


@dataclasses.dataclass
class SimResult:
    run: RunResult  # bench serve's metrics (vLLM's keys) of the simulated run
    stats: SimStats
    token_times: list[list[float]]  # per request, when each of its tokens reached the client
    # Per launched step, for tests and tools: what the scheduler decided (request ids and
    # tokens per row) and the step's features. Recorded only with record_steps=True.
    decisions: list[tuple[tuple[str, ...], tuple[int, ...]]] = dataclasses.field(
        default_factory=list
    )
    features: list[StepFeatures] = dataclasses.field(default_factory=list)


def build_core(engine: SimEngine, executor) -> EngineCore:
    cfg = engine.scheduler
    allocator = PageAllocator(engine.num_pages, cfg.page_size, cfg.enable_prefix_caching)
    scheduler = Scheduler(cfg, allocator)
    builder = PlanBuilder(
        cfg.max_num_seqs,
        cfg.max_pages_per_seq,
        cfg.page_size,
        engine.num_pages,
        scheduler.buckets,
        engine.vocab_size,
    )
    return EngineCore(scheduler, builder, executor, async_scheduling=engine.async_scheduling)


def core_request(i: int, r: SimRequest) -> EngineCoreRequest:
    params = SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True)
    return EngineCoreRequest(str(i), r.prompt, params, 0, [], r.arrival_s)


def simulate(
    engine: SimEngine,
    costs: StepCosts,
    requests: Sequence[SimRequest],
    *,
    request_rate: float,
    percentiles: Sequence[float] = (99.0,),
    goodput_slos_ms: Mapping[str, float] | None = None,
    frontend: Frontend = NO_FRONTEND,
    core_io: CoreIO = NO_CORE_IO,
    feature_max: Mapping[str, float] | None = None,
    record_steps: bool = False,
    prepare: Callable[[EngineCore, int, SimRequest], None] | None = None,
) -> SimResult:
    """Serve `requests` (arrival times non-decreasing) on the simulated engine.

    `prepare(core, index, request)`, if given, runs just before a request is added (the
    disaggregated decode side uses it to place transferred KV in the prefix cache)."""
    arrivals = [r.arrival_s for r in requests]
    if any(b < a for a, b in zip(arrivals, arrivals[1:], strict=False)):
        raise ValueError("requests must be sorted by arrival time")
    for r in requests:
        if len(r.prompt) + r.output_len > engine.scheduler.max_model_len:
            raise ValueError(
                f"a request of {len(r.prompt)} + {r.output_len} tokens exceeds "
                f"max_model_len={engine.scheduler.max_model_len}"
            )
    clock = SimClock()
    ex = SimExecutor(costs, clock, engine.scheduler.max_num_seqs, feature_max, record_steps)
    core = build_core(engine, ex)
    stats = SimStats()
    times: list[list[float]] = [[] for _ in requests]
    rejected_at: dict[int, float] = {}
    front_free = [0.0] * frontend.servers
    # Requests through their API server (frontend.request_s), not yet at the core: (time, index).
    entering: list[tuple[float, int]] = []
    nxt, idle_spins = 0, 0
    while True:
        while nxt < len(requests) and requests[nxt].arrival_s <= clock.now:
            if frontend.request_s:
                t_in = frontend.admit(nxt, requests[nxt].arrival_s, front_free)
                heapq.heappush(entering, (t_in, nxt))
            else:
                heapq.heappush(entering, (requests[nxt].arrival_s, nxt))
            nxt += 1
        while entering and entering[0][0] <= clock.now:
            _, i = heapq.heappop(entering)
            if prepare is not None:
                prepare(core, i, requests[i])
            try:
                core.add_request(core_request(i, requests[i]))
            except QueueFullError:
                rejected_at[i] = clock.now
        if core.has_unfinished():
            out = core.step()
        elif core.has_in_flight:
            out = core.drain()
        elif entering or nxt < len(requests):
            due = [entering[0][0]] if entering else []
            due += [requests[nxt].arrival_s] if nxt < len(requests) else []
            clock.now = max(clock.now, min(due))
            continue
        else:
            break
        st = out.stats
        if st.num_steps == 0 and not out.request_ids and not core.has_in_flight:
            idle_spins += 1  # nothing launched, nothing delivered: the scheduler is stuck
            if idle_spins > 2:
                raise RuntimeError(
                    f"the scheduler made no progress at t={clock.now:.3f}s with "
                    f"{st.num_running} running and {st.num_waiting} waiting requests"
                )
        else:
            idle_spins = 0
        if core_io.enabled and (st.num_steps or out.request_ids):
            io = core_io.seconds(len(out.request_ids))  # the outputs leave after the send
            clock.now += io
            clock.host_busy += io
        if frontend.enabled and out.request_ids:
            delivered = frontend.deliver(clock.now, out.request_ids, front_free)
            for rid, t in zip(out.request_ids, delivered, strict=True):
                times[int(rid)].append(t)
        else:
            for rid in out.request_ids:
                times[int(rid)].append(clock.now)
        stats.steps += st.num_steps
        stats.num_preemptions += st.num_preemptions
        stats.prefix_cache_hits += st.prefix_cache_hits
        stats.prefix_cache_queries += st.prefix_cache_queries
        stats.times.append(clock.now)
        stats.in_core.append(st.num_running + st.num_waiting)
    st_times = core.step_times
    stats.tokens, stats.padded_tokens = st_times.tokens, st_times.padded_tokens
    stats.simulated_s = max(clock.now, *front_free)
    stats.device_busy_s, stats.host_busy_s = clock.device_busy, clock.host_busy
    stats.rejected = len(rejected_at)
    stats.steps_beyond_calibration = ex.beyond
    run = run_result(requests, times, rejected_at, request_rate, percentiles, goodput_slos_ms)
    if stats.steps and ex.beyond / stats.steps > 0.01:
        limits = ", ".join(f"{k} {v:g}" for k, v in (feature_max or {}).items())
        run.warnings.append(
            f"{ex.beyond} of {stats.steps} steps lie beyond the calibrated profiles ({limits}): "
            "the step model extrapolates there"
        )
    return SimResult(run, stats, times, ex.decisions, ex.features)


def run_result(
    requests: Sequence[SimRequest],
    times: list[list[float]],
    rejected_at: Mapping[int, float],
    rate: float,
    percentiles: Sequence[float],
    goodput_slos_ms: Mapping[str, float] | None,
) -> RunResult:
    results = []
    for i, (r, ts) in enumerate(zip(requests, times, strict=True)):
        res = RequestResult(i, r.arrival_s, dispatched_s=r.arrival_s, sent_s=r.arrival_s)
        if i in rejected_at:
            res.error, res.latency_s = QUEUE_FULL, rejected_at[i] - r.arrival_s
        else:
            assert len(ts) == r.output_len, f"request {i}: {len(ts)} of {r.output_len} tokens"
            res.success, res.error, res.finish_reason = True, "", "length"
            res.ttft_s, res.latency_s = ts[0] - r.arrival_s, ts[-1] - r.arrival_s
            res.itl_s = np.diff(ts).tolist()
            res.output_tokens = len(ts)
        results.append(res)
    input_lens = [len(r.prompt) for r in requests]
    ends = [r.sent_s + r.latency_s for r in results]
    duration = max(ends, default=0.0)
    metrics = compute_metrics(results, input_lens, duration, percentiles, goodput_slos_ms or {})
    return RunResult(
        rate if math.isfinite(rate) else math.inf, metrics, results, input_lens, {}, []
    )
