"""Engine metrics, named after vLLM's with a `nori:` prefix, kept in a prometheus_client registry.

One registry per engine: the server exposes it at /metrics, `LLM.get_metrics()` reads the same
numbers as a dict, so the two can never disagree.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from nori_jax.core.outputs import EngineCoreOutputs, FinishedRequest

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
)
_TOKEN_LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
)
_STEP_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.002,
    0.004,
    0.008,
    0.016,
    0.032,
    0.064,
    0.128,
    0.256,
    0.512,
    1.024,
    2.048,
)
FINISH_REASONS = ("stop", "length", "abort", "error")


class EngineMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry

        def hist(name: str, doc: str, buckets=_LATENCY_BUCKETS) -> Histogram:
            return Histogram(f"nori:{name}", doc, buckets=buckets, registry=r)

        self.ttft = hist("time_to_first_token_seconds", "Arrival to first output token.")
        self.tpot = hist(
            "time_per_output_token_seconds",
            "Mean time between output tokens of a request (decode time / (tokens - 1)).",
            _TOKEN_LATENCY_BUCKETS,
        )
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish.")
        self.queue_time = hist("request_queue_time_seconds", "Arrival to first scheduled.")
        self.prefill_time = hist("request_prefill_time_seconds", "First scheduled to first token.")
        self.decode_time = hist("request_decode_time_seconds", "First token to last token.")
        # Disaggregated engines (core/disaggregated_core.py): the stage between prefill and decode.
        self.transfer_time = hist(
            "request_transfer_time_seconds",
            "First token (end of prefill) to the request's KV pages landed in the decode "
            "engine's pool, waiting for room there included.",
        )
        self.kv_transfer_bytes = Counter(
            "nori:kv_transfer_bytes",
            "KV cache bytes moved from prefill to decode engines.",
            registry=r,
        )
        self.kv_transfers = Counter(
            "nori:kv_transfers",
            "KV moves from prefill to decode engines, by result (a failed one is retried).",
            ["result"],
            registry=r,
        )
        for result in ("ok", "failed"):
            self.kv_transfers.labels(result=result)
        self.step_duration = hist(
            "step_duration_seconds", "Wall time of one engine step.", _STEP_BUCKETS
        )
        # Launches by shape (core/step_shapes.py), the wall time `bench offline` tabulates
        self.launches = Counter(
            "nori:step_launches",
            "Launches fetched, by token bucket and kind (decode, mixed, prefill).",
            ["bucket", "kind"],
            registry=r,
        )
        self.launch_seconds = Counter(
            "nori:step_launch_seconds",
            "Wall time of the launches fetched, by token bucket and kind: from the previous "
            "launch's samples on the host (or its own launch, after an idle spell) to its own.",
            ["bucket", "kind"],
            registry=r,
        )
        self.core_io = Counter(
            "nori:engine_core_io_seconds",
            "The engine-core process's time outside its steps: reading requests off its socket, "
            "encoding and sending each step's outputs to the API servers.",
            registry=r,
        )
        self.scheduler_duration = hist(
            "scheduler_duration_seconds",
            "Host time to schedule one step and build its plan.",
            _STEP_BUCKETS,
        )
        self.running = Gauge(
            "nori:num_requests_running", "Requests in the running batch.", registry=r
        )
        self.waiting = Gauge(
            "nori:num_requests_waiting", "Requests waiting for admission.", registry=r
        )
        self.kv_usage = Gauge(
            "nori:kv_cache_usage_perc", "Fraction of KV pages in use (0-1).", registry=r
        )
        self.prompt_tokens = Counter(
            "nori:prompt_tokens", "Prompt tokens of finished requests.", registry=r
        )
        self.generation_tokens = Counter("nori:generation_tokens", "Generated tokens.", registry=r)
        self.success = Counter(
            "nori:request_success",
            "Finished requests by finish reason.",
            ["finished_reason"],
            registry=r,
        )
        for reason in FINISH_REASONS:
            self.success.labels(finished_reason=reason)
        self.preemptions = Counter(
            "nori:num_preemptions", "Requests preempted (recomputed).", registry=r
        )
        self.recompiles = Counter(
            "nori:recompiles", "XLA programs built after warm-up.", registry=r
        )
        self.prefix_hits = Counter(
            "nori:prefix_cache_hits", "Prompt tokens served from the prefix cache.", registry=r
        )
        self.prefix_queries = Counter(
            "nori:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", registry=r
        )
        # The server's engine-core process: restarts after it died, and how long the last took.
        self.engine_restarts = Counter(
            "nori:engine_restarts", "Engine restarts after the engine died.", registry=r
        )
        self.engine_recovery = Gauge(
            "nori:engine_recovery_seconds",
            "Seconds from the engine's death to serving again, for the last restart.",
            registry=r,
        )
        # RL loops (weight_control.py): whether the engine lends its memory, and weight swaps.
        self.engine_sleeping = Gauge(
            "nori:engine_sleeping",
            "1 while the engine sleeps (sleep(): its device memory given back), else 0.",
            registry=r,
        )
        self.weight_updates = Counter(
            "nori:weight_updates",
            "New weights placed in the running engine (update_weights, wake_up with weights).",
            registry=r,
        )
        # nori:model_config_info{dtype=...,quantization=...,weights=...,quantized_matmul=...,
        # kv_cache_dtype=...,kv_scales=...,gpu_client=...} 1
        self.model_config = Info(
            "nori:model_config",
            "Compute dtype, how the weights are stored, the KV pages' dtype, XLA's GPU client.",
            registry=r,
        )

    def observe_weight_op(self, op: str, asleep: bool, new_weights: bool) -> None:
        """A weight operation done (weight_control.py): the sleeping state after it, and whether
        it placed new weights."""
        self.engine_sleeping.set(int(asleep))
        if new_weights:
            self.weight_updates.inc()

    def observe_engine_death(self, failed: int) -> None:
        """The engine core died: its `failed` accepted requests ended with an error, and its
        batch, queue and pages are gone (the gauges would otherwise keep the dead core's last
        step until a new one steps, for ever where none is restarted)."""
        self.success.labels(finished_reason="error").inc(failed)
        self.running.set(0)
        self.waiting.set(0)
        self.kv_usage.set(0)

    def set_model_config(self, info: dict[str, str]) -> None:
        """dtype, quantization and weights (LoadedModel.model_config_info)."""
        self.model_config.info(info)

    def observe(self, outs: EngineCoreOutputs) -> None:
        """One engine step's outputs: tokens, first tokens, finishes and the scheduler's state."""
        st = outs.stats
        # The step's count from its stats: an API server sharing the core with others receives
        # only its own requests' rows, and every step's stats (engine_core_process.py).
        generated = len(outs.request_ids) if st is None else st.num_generated_tokens
        if generated:
            self.generation_tokens.inc(generated)
        for first in outs.first_tokens:
            self.ttft.observe(first.time_to_first_token)
        for f in outs.finished:
            self.observe_finished(f)
        for t in outs.transfers:
            if t.error is not None:
                self.kv_transfers.labels(result="failed").inc()
                continue
            self.kv_transfers.labels(result="ok").inc()
            self.transfer_time.observe(t.seconds)
            self.kv_transfer_bytes.inc(t.num_bytes)
        if st is None:
            return
        self.running.set(st.num_running)
        self.waiting.set(st.num_waiting)
        self.kv_usage.set(st.kv_usage)
        if st.num_preemptions:
            self.preemptions.inc(st.num_preemptions)
        if st.prefix_cache_queries:
            self.prefix_hits.inc(st.prefix_cache_hits)
            self.prefix_queries.inc(st.prefix_cache_queries)
        if st.num_recompiles:
            self.recompiles.inc(st.num_recompiles)
        if st.num_steps:
            self.scheduler_duration.observe(st.schedule_seconds)
        if st.step_seconds:
            self.step_duration.observe(st.step_seconds)
        if st.io_seconds:
            self.core_io.inc(st.io_seconds)
        for bucket, kind, seconds in st.launches:
            self.launches.labels(bucket=str(bucket), kind=kind).inc()
            self.launch_seconds.labels(bucket=str(bucket), kind=kind).inc(seconds)

    def observe_finished(self, f: FinishedRequest) -> None:
        m = f.metrics
        self.prompt_tokens.inc(f.num_prompt_tokens)
        self.success.labels(finished_reason=f.finish_reason).inc()
        if m.e2e_latency is not None:
            self.e2e.observe(m.e2e_latency)
        if m.queue_time is not None:
            self.queue_time.observe(m.queue_time)
        if m.prefill_time is not None:
            self.prefill_time.observe(m.prefill_time)
        if m.decode_time is not None:
            self.decode_time.observe(m.decode_time)
            if f.num_output_tokens > 1:
                self.tpot.observe(m.decode_time / (f.num_output_tokens - 1))

    def as_dict(self) -> dict[str, Any]:
        """Counters and gauges as numbers (labelled ones as {label: value}); histograms as
        {"count", "sum"}."""
        out: dict[str, Any] = {}
        for family in self.registry.collect():
            if family.type == "histogram":
                samples = {s.name: s.value for s in family.samples if not s.labels.get("le")}
                out[family.name] = {
                    "count": samples.get(f"{family.name}_count", 0.0),
                    "sum": samples.get(f"{family.name}_sum", 0.0),
                }
            elif family.type == "info":
                for s in family.samples:
                    out[s.name] = dict(s.labels)
            elif family.type == "counter":
                for s in family.samples:
                    if not s.name.endswith("_total"):
                        continue
                    if s.labels:  # keyed by the label's value ("16/decode" for two labels)
                        key = "/".join(s.labels.values())
                        out.setdefault(s.name, {})[key] = s.value
                    else:
                        out[s.name] = s.value
            else:
                for s in family.samples:
                    out[s.name] = s.value
        return out
