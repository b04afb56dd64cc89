"""One `bench serve` run: the server's model and tokenizer, the workload (built once), a schedule
at one rate, the client processes, the metrics and the warnings.

The workload and the arrival pattern come from separate seeded streams, so every rate of a sweep
sends the same lengths, and the gap pattern is the same one rescaled to the rate.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import urllib.request
from collections.abc import Callable
from typing import Any

import numpy as np

from nori_jax.bench.client import RequestResult, ShardOutcome, ShardSpec, WireRequest, request_body
from nori_jax.bench.config import BenchConfig
from nori_jax.bench.metrics import client_health, compute_metrics, rate_warnings
from nori_jax.bench.prompts import (
    BenchRequest,
    TokenizerPrompts,
    build_requests,
    load_tokenizer,
    served_tokenizer,
)
from nori_jax.bench.server_metrics import Snapshot, scrape, window
from nori_jax.bench.workers import run_workers

_SEED_CONTENT = 3  # the stream of a sweep's fresh prompt tokens
FAILED_WARN_FRACTION = 0.01  # past this share of failed requests, the percentiles mislead
# Fewer chunks than this share of the output tokens: the stream batches tokens (the server's
# detokenizer holds back a partial character or a stop string's prefix now and then, so a
# little batching is normal).
CHUNKS_WARN_FRACTION = 0.5


@dataclasses.dataclass(frozen=True)
class Workload:
    model: str
    tokenizer: str | None  # where the tokenizer came from; None: word estimates
    prompts: TokenizerPrompts | None
    requests: list[BenchRequest]
    warmup: list[BenchRequest]
    bodies: list[bytes]  # serialised once: the client processes only send bytes
    warmup_bodies: list[bytes]


@dataclasses.dataclass(frozen=True)
class RunResult:
    request_rate: float
    metrics: dict[str, Any]  # vLLM's result keys (metrics.py)
    results: list[RequestResult]  # by request index
    input_lens: list[int]
    health: dict[str, Any]
    warnings: list[str]
    interrupted: bool = False  # Ctrl-C: `results` holds what had finished
    # The server's /metrics over the measured requests (server_metrics.SERVER_KEYS and
    # ERROR_KEY); empty when not scraped (a simulated run)
    server: dict[str, Any] = dataclasses.field(default_factory=dict)


def default_num_processes(num_prompts: int) -> int:
    """Half the cores (the server may share the machine), at most 8, at most one per request."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(8, (cores or 1) // 2, num_prompts))


def model_cards(cfg: BenchConfig, timeout_s: float = 30.0) -> list[dict[str, Any]]:
    """The server's GET /v1/models cards (no proxies: like the load, straight to the server)."""
    url = cfg.base_url.rstrip("/") + "/v1/models"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    request = urllib.request.Request(url, headers=dict(cfg.headers))
    try:
        with opener.open(request, timeout=timeout_s) as r:
            cards = json.loads(r.read())["data"]
        if not all(isinstance(c, dict) and "id" in c for c in cards):
            raise TypeError("no model cards")
        return cards
    except (OSError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"could not read the model list from {url} ({e})") from e


def prepare_workload(cfg: BenchConfig) -> Workload:
    """The server's model (the first it lists unless --model), its tokenizer (--tokenizer, else
    the one its model card names), and the run's requests and warm-up requests, serialised."""
    model, tokenizer, source = cfg.model, None, cfg.tokenizer
    if cfg.tokenizer is not None:
        tokenizer = load_tokenizer(cfg.tokenizer)
    if model is None or tokenizer is None:
        try:
            cards = model_cards(cfg)
        except ValueError as e:
            if model is None:
                raise ValueError(f"{e}; pass --model") from None
            cards = []  # the model is known; prompts fall back to word estimates
        model = model or cards[0]["id"]
        card = next((c for c in cards if c["id"] == model), None)
        if tokenizer is None and card is not None and (found := served_tokenizer(card)):
            if not cfg.chat or found[0].chat_template is not None:  # else: the server's own
                tokenizer, source = found
    if cfg.prompt_format == "token-ids" and tokenizer is None and cfg.workload.dataset != "jsonl":
        raise ValueError(
            "token-id prompts need a tokenizer: pass --tokenizer (the server's model card names "
            "none this client can load)"
        )
    prompts = (
        TokenizerPrompts(tokenizer, "chat" if cfg.chat else "completions") if tokenizer else None
    )
    return _build(cfg, model, source, prompts, variant=0)


def fresh_prompts(cfg: BenchConfig, w: Workload, variant: int) -> Workload:
    """Other prompt tokens of the same lengths (and the same warm-up): a sweep's later rates,
    which a prefix-caching server then cannot serve from an earlier rate's cache. JSONL prompts
    come from the file and are the same in every variant."""
    return _build(cfg, w.model, w.tokenizer, w.prompts, variant)


def _build(
    cfg: BenchConfig, model: str, source: str | None, prompts: TokenizerPrompts | None, variant: int
) -> Workload:
    w = cfg.workload
    data_rng, warm_rng = w.streams()
    content_rng = np.random.default_rng([w.seed, _SEED_CONTENT, variant]) if variant else None
    token_ids = cfg.prompt_format == "token-ids"
    requests = build_requests(w, prompts, token_ids, w.num_prompts, data_rng, 0, content_rng)
    # negative indices: warm-up requests can never be mistaken for requests of the run
    n = w.warmup_requests
    warmup = build_requests(w, prompts, token_ids, n, warm_rng, first_index=-n)
    options = {"temperature": cfg.temperature} | ({"ignore_eos": True} if cfg.ignore_eos else {})
    options |= cfg.extra_body
    body = lambda r: request_body(  # noqa: E731
        cfg.chat, model, r.prompt, r.output_len, cfg.max_tokens_field, options
    )
    return Workload(
        model,
        source,
        prompts,
        requests,
        warmup,
        [body(r) for r in requests],
        [body(r) for r in warmup],
    )


def run_once(
    cfg: BenchConfig, w: Workload, rate: float, progress: Callable[[int], None]
) -> RunResult:
    arrivals = cfg.workload.arrival_times(len(w.requests), rate)
    wires = [
        WireRequest(r.index, float(t), body)
        for r, t, body in zip(w.requests, arrivals, w.bodies, strict=True)
    ]
    warm = [WireRequest(r.index, 0.0, b) for r, b in zip(w.warmup, w.warmup_bodies, strict=True)]
    # The server's /metrics totals after the warm-up, just before the start, and after the end.
    # One scrape is right even with `serve --api-server-count N`: whichever API server answers,
    # its /metrics holds the whole engine's steps (the core sends every server every step's
    # stats and finishes). A server without them leaves the fields None (server_metrics.py).
    before: list[Snapshot | str] = []
    on_ready = lambda: before.append(scrape(cfg.base_url, cfg.headers))  # noqa: E731
    outcomes, interrupted = run_workers(_shards(cfg, wires, warm), progress, on_ready)
    start = before[0] if before else "the run never started"
    after = scrape(cfg.base_url, cfg.headers) if isinstance(start, Snapshot) else start
    server = window(start, after)
    results = sorted((r for o in outcomes for r in o.results), key=lambda r: r.index)
    if w.prompts is not None:
        count_output_by_tokenizer(w.prompts, results)
    input_lens = [
        res.server_prompt_tokens
        if not req.exact and res.server_prompt_tokens is not None
        else req.prompt_len
        for req, res in zip(w.requests, results, strict=True)
    ]  # the client's count when exact, else the server's own when it reports one
    ends = [r.sent_s + r.latency_s for r in results if math.isfinite(r.sent_s)]
    duration = max(ends, default=float(arrivals[-1]))
    m = cfg.metric_percentiles
    metrics = compute_metrics(results, input_lens, duration, m, cfg.goodput_slos_ms)
    health, warnings = client_health(outcomes, math.isfinite(rate), metrics["median_itl_ms"])
    warnings += rate_warnings(results, rate, cfg.max_concurrency)
    warnings += _warnings(cfg, w, results, outcomes)
    return RunResult(rate, metrics, results, input_lens, health, warnings, interrupted, server)


def count_output_by_tokenizer(prompts: TokenizerPrompts, results: list[RequestResult]) -> None:
    """Output tokens of successful requests the server sent no usage for: their generated text
    tokenized (as vLLM's benchmark counts them). Counting text chunks instead undercounts a
    server that packs several tokens into a chunk."""
    todo = [
        r
        for r in results
        if r.success and r.output_tokens_source == "chunks" and not r.usage_below_chunks
    ]
    if not todo:
        return
    encoded = prompts.tokenizer.backend.encode_batch(
        [r.generated_text for r in todo], add_special_tokens=False
    )
    for r, e in zip(todo, encoded, strict=True):
        # never below the chunks: each text chunk holds at least one token
        r.output_tokens, r.output_tokens_source = max(len(e.ids), r.output_tokens), "tokenizer"


def _shards(cfg: BenchConfig, wires: list[WireRequest], warm: list[WireRequest]) -> list[ShardSpec]:
    """Deal requests round-robin; split --max-concurrency so the shares sum to it exactly."""
    cap = cfg.max_concurrency
    num = min(cfg.num_processes, len(wires), cap or len(wires))
    headers = dict(cfg.headers) | {"Content-Type": "application/json"}
    return [
        ShardSpec(
            url=cfg.url,
            headers=headers,
            chat=cfg.chat,
            timeout_s=cfg.request_timeout_s if math.isfinite(cfg.request_timeout_s) else None,
            concurrency=None if cap is None else cap // num + (1 if i < cap % num else 0),
            requests=wires[i::num],
            warmup=warm[i::num],
        )
        for i in range(num)
    ]


def _warnings(
    cfg: BenchConfig, w: Workload, results: list[RequestResult], outcomes: list[ShardOutcome]
) -> list[str]:
    warnings = []
    pairs = list(zip(w.requests, results, strict=True))
    off = [
        (req.prompt_len, res.server_prompt_tokens)
        for req, res in pairs
        if req.exact and res.server_prompt_tokens not in (None, req.prompt_len)
    ]
    if off:
        built, counted = off[0]
        warnings.append(
            f"the server counted other prompt lengths than the client built for {len(off)} "
            f"requests (e.g. {counted} vs {built}): a different tokenizer, or BOS handling"
        )
    if not any(req.exact for req in w.requests):
        warnings.append(
            "input lengths are estimates (no tokenizer: pass --tokenizer); server-reported "
            "counts are used where the server gives them"
        )
    short = [res for req, res in pairs if res.success and res.output_tokens < req.output_len]
    if cfg.ignore_eos and short:
        warnings.append(
            f"{len(short)} requests produced fewer tokens than max_tokens despite ignore_eos: "
            "the server may not support it"
        )
    warm_errors = [e for o in outcomes for e in o.warmup_errors]
    if warm_errors:
        warnings.append(f"{len(warm_errors)} warm-up requests failed, e.g. {warm_errors[0]}")
    if results and not any(r.success for r in results):
        warnings.append("every request failed: check --base-url, --endpoint and --model")
    failed = sum(not r.success for r in results)
    if results and failed > FAILED_WARN_FRACTION * len(results) and failed < len(results):
        warnings.append(
            f"{failed} of {len(results)} requests failed: the latency figures are over the "
            "successful ones only, and a server that fails requests quickly looks faster than "
            "it is"
        )
    warnings += _usage_warnings(results)
    streamed = [r for r in results if r.success and r.output_tokens > 1]
    chunks = sum(len(r.itl_s) + 1 for r in streamed)
    tokens = sum(r.output_tokens for r in streamed)
    if streamed and chunks < CHUNKS_WARN_FRACTION * tokens:
        warnings.append(
            f"the stream's chunks carried {tokens / chunks:.1f} tokens each on average: TTFT, "
            "ITL and TPOT are timed per chunk, so a token that waited in a chunk counts as "
            "arriving with it (a request whose tokens came in one chunk has a TPOT of 0)"
        )
    return warnings


def _usage_warnings(results: list[RequestResult]) -> list[str]:
    """Output token counts the server's usage did not give, and why."""
    ok = [r for r in results if r.success]
    warnings = []
    invalid = sum(r.usage_invalid for r in ok)
    if invalid:
        warnings.append(
            f"{invalid} requests had a usage block whose counts are not integers >= 0: ignored, "
            "as if the server had sent no usage"
        )
    below = sum(r.usage_below_chunks for r in ok)
    if below:
        warnings.append(
            f"the server's usage is lower than the chunks it sent for {below} requests (each "
            "text chunk holds at least one token): their output tokens are the chunk counts"
        )
    tokenized = sum(r.output_tokens_source == "tokenizer" for r in ok)
    if tokenized:
        warnings.append(
            f"the server sent no usage for {tokenized} requests: their output tokens were "
            "counted by tokenizing the generated text"
        )
    chunked = sum(r.output_tokens_source == "chunks" and not r.usage_below_chunks for r in ok)
    if chunked:
        warnings.append(
            f"the output tokens of {chunked} requests are counted text chunks (no usage from the "
            "server, no tokenizer to count their text: pass --tokenizer), which undercounts a "
            "server that sends several tokens per chunk"
        )
    return warnings
