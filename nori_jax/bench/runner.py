"""One benchmark run: the workload (built once), a schedule at one rate, the client, the metrics.

The workload and the arrival pattern come from separate seeded streams, so every rate of a sweep
sends the same prompts, and the gap pattern is the same one rescaled to the rate.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import urllib.request
from collections.abc import Callable

import numpy as np

from nori_jax.bench.arrivals import arrival_times
from nori_jax.bench.config import BenchConfig, ClientConfig
from nori_jax.bench.dataset import BenchRequest, build_requests
from nori_jax.bench.driver import run_shards
from nori_jax.bench.health import ClientHealth, assess
from nori_jax.bench.metrics import BenchmarkMetrics, compute_metrics
from nori_jax.bench.prompts import TokenizerPrompts, WordPrompts, load_tokenizer
from nori_jax.bench.shard import ShardSpec
from nori_jax.bench.stream_request import RequestResult, WireRequest
from nori_jax.bench.wire import request_body

_SEED_DATA, _SEED_WARMUP, _SEED_ARRIVALS, _SEED_CONTENT = 0, 1, 2, 3


def seeded_streams(seed: int) -> tuple[np.random.Generator, ...]:
    """(requests, warm-up requests, arrivals) generators of a seed. `bench offline` draws from
    the same streams in the same order, so for one seed it runs the lengths and arrival times
    that `bench serve` sends."""
    return _rngs(seed, _SEED_DATA, _SEED_WARMUP, _SEED_ARRIVALS)


@dataclasses.dataclass(frozen=True)
class Workload:
    model: str
    requests: list[BenchRequest]
    warmup: list[BenchRequest]
    bodies: list[bytes]  # serialised once: the client processes only send bytes
    warmup_bodies: list[bytes]


@dataclasses.dataclass(frozen=True)
class RunResult:
    request_rate: float
    metrics: BenchmarkMetrics
    results: list[RequestResult]  # by request index
    input_lens: list[int]
    health: ClientHealth
    warnings: list[str]


def default_num_processes(num_prompts: int) -> int:
    """Half the cores (the server may share the machine), at most 8, at most one per request."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(8, (cores or 1) // 2, num_prompts))


def discover_model(client: ClientConfig, timeout_s: float = 30.0) -> str:
    """The first model the server lists, as vLLM's client does when --model is not given."""
    url = client.base_url.rstrip("/") + "/v1/models"
    # no proxy handler: like the load itself, the lookup goes straight to the server
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    request = urllib.request.Request(url, headers=dict(client.headers))
    try:
        with opener.open(request, timeout=timeout_s) as resp:
            return str(json.loads(resp.read())["data"][0]["id"])
    except (OSError, KeyError, IndexError, TypeError, ValueError) as e:
        raise ValueError(f"could not read a model name from {url} ({e}); pass --model") from e


def prepare_workload(cfg: BenchConfig, variant: int = 0, model: str | None = None) -> Workload:
    """The run's requests and warm-up requests, serialised.

    variant > 0 keeps every length and the warm-up but draws other prompt tokens (a sweep's later
    rates): a server with prefix caching then cannot serve one rate's prompts from another's
    cache. JSONL prompts come from the file and are the same in every variant.
    """
    model = model or cfg.client.model or discover_model(cfg.client)
    endpoint = cfg.client.endpoint_kind
    if cfg.tokenizer_path is not None:
        prompts: TokenizerPrompts | WordPrompts = TokenizerPrompts(
            load_tokenizer(cfg.tokenizer_path), endpoint
        )
    else:
        prompts = WordPrompts(endpoint)
    data_rng, warm_rng, _ = seeded_streams(cfg.seed)
    content_rng = np.random.default_rng([cfg.seed, _SEED_CONTENT, variant]) if variant else None
    requests = build_requests(
        cfg.dataset, prompts, cfg.dataset.num_prompts, data_rng, content_rng=content_rng
    )
    # negative indices: warm-up requests can never be mistaken for requests of the run
    n_warm = cfg.warmup_requests
    warmup = build_requests(cfg.dataset, prompts, n_warm, warm_rng, first_index=-n_warm)
    return Workload(
        model,
        requests,
        warmup,
        [_body(cfg, model, r) for r in requests],
        [_body(cfg, model, r) for r in warmup],
    )


def run_once(
    cfg: BenchConfig,
    workload: Workload,
    request_rate: float | None = None,
    progress: Callable[[int], None] | None = None,
) -> RunResult:
    rate = cfg.load.request_rate if request_rate is None else request_rate
    n = len(workload.requests)
    *_, arr_rng = seeded_streams(cfg.seed)
    arrivals = arrival_times(n, rate, cfg.load.burstiness, arr_rng)
    wires = [
        WireRequest(r.index, float(t), body, r.output_len)
        for r, t, body in zip(workload.requests, arrivals, workload.bodies, strict=True)
    ]
    warm_wires = [
        WireRequest(r.index, 0.0, body, r.output_len)
        for r, body in zip(workload.warmup, workload.warmup_bodies, strict=True)
    ]
    outcomes = run_shards(_shards(cfg, wires, warm_wires), progress)

    results = sorted((r for o in outcomes for r in o.results), key=lambda r: r.index)
    input_lens = [_input_len(req, res) for req, res in zip(workload.requests, results, strict=True)]
    ends = [r.sent_s + r.latency_s for r in results if math.isfinite(r.sent_s)]
    duration = max(ends, default=float(arrivals[-1]))
    metrics = compute_metrics(
        results,
        input_lens,
        duration,
        cfg.report.metric_percentiles,
        cfg.report.goodput_slos_ms,
    )
    health, warnings = assess(outcomes, math.isfinite(rate), metrics.itl.median)
    warnings += _workload_warnings(cfg, workload, results, outcomes)
    return RunResult(rate, metrics, results, input_lens, health, warnings)


def _rngs(seed: int, *streams: int) -> list[np.random.Generator]:
    return [np.random.default_rng([seed, s]) for s in streams]


def _body(cfg: BenchConfig, model: str, r: BenchRequest) -> bytes:
    c = cfg.client
    return request_body(
        c.endpoint_kind,
        model,
        r.prompt,
        r.output_len,
        ignore_eos=c.ignore_eos,
        temperature=c.temperature,
        max_tokens_field=c.max_tokens_field,
        extra_body=c.extra_body,
    )


def _shards(cfg: BenchConfig, wires: list[WireRequest], warm: list[WireRequest]) -> list[ShardSpec]:
    """Deal requests round-robin; split --max-concurrency so the shares sum to it exactly."""
    cap = cfg.load.max_concurrency
    num = min(cfg.client.num_processes, len(wires), cap or len(wires))
    shards = []
    for w in range(num):
        share = None if cap is None else cap // num + (1 if w < cap % num else 0)
        shards.append(
            ShardSpec(
                url=cfg.client.url,
                headers=dict(cfg.client.headers) | {"Content-Type": "application/json"},
                endpoint=cfg.client.endpoint_kind,
                timeout_s=cfg.client.request_timeout_s,
                concurrency=share,
                requests=wires[w::num],
                warmup=warm[w::num],
            )
        )
    return shards


def _input_len(req: BenchRequest, res: RequestResult) -> int:
    """The client's count when it is exact, else the server's own count when it reports one."""
    if not req.prompt_len_exact and res.server_prompt_tokens is not None:
        return res.server_prompt_tokens
    return req.prompt_len


def _workload_warnings(
    cfg: BenchConfig, workload: Workload, results: list[RequestResult], outcomes: list
) -> list[str]:
    warnings = []
    pairs = list(zip(workload.requests, results, strict=True))
    off = [
        (req.prompt_len, res.server_prompt_tokens)
        for req, res in pairs
        if req.prompt_len_exact
        and res.server_prompt_tokens is not None
        and res.server_prompt_tokens != req.prompt_len
    ]
    if off:
        built, counted = off[0]
        warnings.append(
            f"the server counted other prompt lengths than the client built for {len(off)} "
            f"requests (e.g. {counted} vs {built}): a different tokenizer, or BOS handling"
        )
    if not any(req.prompt_len_exact for req in workload.requests):
        warnings.append(
            "input lengths are estimates (no --tokenizer); server-reported counts are used "
            "where the server gives them"
        )
    if cfg.client.ignore_eos:
        short = [res for req, res in pairs if res.success and res.output_tokens < req.output_len]
        if short:
            warnings.append(
                f"{len(short)} requests produced fewer tokens than max_tokens despite "
                "ignore_eos: the server may not support it"
            )
    failed_warm = sum(o.warmup_failed for o in outcomes)
    if failed_warm:
        err = next(o.warmup_error for o in outcomes if o.warmup_failed)
        warnings.append(f"{failed_warm} warm-up requests failed, e.g. {err}")
    if results and not any(r.success for r in results):
        warnings.append("every request failed: check --base-url, --endpoint and --model")
    return warnings
