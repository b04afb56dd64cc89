"""Frozen, validated configuration of one `bench serve` run. The CLI only fills these in."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Literal

DatasetKind = Literal["lognormal", "fixed", "jsonl"]
PromptFormat = Literal["text", "token-ids"]
EndpointKind = Literal["completions", "chat"]

# The two OpenAI routes the client speaks; anything else is rejected up front rather than
# producing a run of 404s.
ENDPOINTS: Mapping[str, EndpointKind] = MappingProxyType(
    {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
)
METRIC_NAMES = ("ttft", "tpot", "itl", "e2el")
GOODPUT_NAMES = ("ttft", "tpot", "e2el")


@dataclasses.dataclass(frozen=True)
class LognormalLengths:
    """Token counts drawn as round(exp(N(mu, sigma))), clipped to [min_len, max_len]."""

    mu: float
    sigma: float
    min_len: int
    max_len: int

    def __post_init__(self) -> None:
        if not math.isfinite(self.mu):
            raise ValueError(f"lognormal mu must be finite, got {self.mu=}")
        if not (math.isfinite(self.sigma) and self.sigma >= 0):
            raise ValueError(f"lognormal sigma must be finite and >= 0, got {self.sigma=}")
        if self.min_len < 1 or self.max_len < self.min_len:
            raise ValueError(f"need 1 <= min_len <= max_len, got {self.min_len=} {self.max_len=}")


# PERF.md's workload. The clip bounds keep input + output within an 8k context (SmolLM2) while
# cutting less than 0.1% of inputs and about 0.1% of outputs.
DEFAULT_INPUT_LENGTHS = LognormalLengths(mu=6.2, sigma=0.8, min_len=1, max_len=6144)
DEFAULT_OUTPUT_LENGTHS = LognormalLengths(mu=5.5, sigma=0.7, min_len=1, max_len=2048)


@dataclasses.dataclass(frozen=True)
class DatasetConfig:
    kind: DatasetKind = "lognormal"
    num_prompts: int = 1000
    input_lengths: LognormalLengths = DEFAULT_INPUT_LENGTHS
    output_lengths: LognormalLengths = DEFAULT_OUTPUT_LENGTHS
    input_len: int = 1024  # `fixed`
    output_len: int = 128  # `fixed`, and `jsonl` lines that give no output length
    path: str | None = None  # `jsonl`
    prompt_format: PromptFormat = "text"

    def __post_init__(self) -> None:
        if self.kind not in ("lognormal", "fixed", "jsonl"):
            raise ValueError(f"unknown dataset {self.kind=}; use lognormal, fixed or jsonl")
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {self.num_prompts=}")
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError(f"lengths must be >= 1, got {self.input_len=} {self.output_len=}")
        if self.kind == "jsonl" and not self.path:
            raise ValueError("the jsonl dataset needs a path (--dataset-path)")
        if self.prompt_format not in ("text", "token-ids"):
            raise ValueError(f"unknown {self.prompt_format=}; use text or token-ids")


@dataclasses.dataclass(frozen=True)
class LoadConfig:
    """When requests leave the client: gamma-distributed gaps at `request_rate` (req/s)."""

    request_rate: float = math.inf  # inf: every request at t=0
    burstiness: float = 1.0  # gamma shape; 1 is a Poisson process, inf evenly spaced
    max_concurrency: int | None = None

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 (or inf), got {self.request_rate=}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness=}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency=}")


@dataclasses.dataclass(frozen=True)
class ClientConfig:
    base_url: str
    endpoint: str = "/v1/completions"
    model: str | None = None  # None: the first model the server lists at /v1/models
    headers: Mapping[str, str] = dataclasses.field(default_factory=dict)
    request_timeout_s: float = 600.0
    num_processes: int = 1
    ignore_eos: bool = False
    temperature: float = 0.0
    max_tokens_field: str = "max_tokens"
    extra_body: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {self.base_url=}")
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"unsupported {self.endpoint=}; use one of {sorted(ENDPOINTS)}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s=}")
        if self.num_processes < 1:
            raise ValueError(f"num_processes must be >= 1, got {self.num_processes=}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature=}")
        if self.max_tokens_field not in ("max_tokens", "max_completion_tokens"):
            raise ValueError(f"unknown {self.max_tokens_field=}")

    @property
    def endpoint_kind(self) -> EndpointKind:
        return ENDPOINTS[self.endpoint]

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + self.endpoint


@dataclasses.dataclass(frozen=True)
class ReportConfig:
    percentile_metrics: tuple[str, ...] = METRIC_NAMES
    metric_percentiles: tuple[float, ...] = (99.0,)
    goodput_slos_ms: Mapping[str, float] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in self.percentile_metrics:
            if name not in METRIC_NAMES:
                raise ValueError(f"unknown percentile metric {name=}; use {METRIC_NAMES}")
        for p in self.metric_percentiles:
            if not 0 < p < 100:
                raise ValueError(f"metric percentiles must be in (0, 100), got {p=}")
        for name, slo in self.goodput_slos_ms.items():
            if name not in GOODPUT_NAMES:
                raise ValueError(f"unknown goodput metric {name=}; use {GOODPUT_NAMES}")
            if not slo >= 0:
                raise ValueError(f"goodput SLO must be >= 0 ms, got {name}:{slo}")


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    client: ClientConfig
    dataset: DatasetConfig = DatasetConfig()
    load: LoadConfig = LoadConfig()
    report: ReportConfig = ReportConfig()
    tokenizer_path: str | None = None
    warmup_requests: int = 0
    seed: int = 0
    label: str | None = None
    show_progress: bool = True

    def __post_init__(self) -> None:
        if self.warmup_requests < 0:
            raise ValueError(f"warmup_requests must be >= 0, got {self.warmup_requests=}")
        if self.dataset.prompt_format == "token-ids":
            if self.client.endpoint_kind != "completions":
                raise ValueError(
                    f"token-id prompts only exist on /v1/completions, got {self.client.endpoint=}"
                )
            if self.tokenizer_path is None and self.dataset.kind != "jsonl":
                raise ValueError("token-id prompts need --tokenizer (to draw ordinary tokens)")
