"""The frozen, validated configuration of a `bench serve` run; the CLI only fills it in."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any

from nori_jax.bench.workload import WorkloadConfig

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
METRIC_NAMES = ("ttft", "tpot", "itl", "e2el")
GOODPUT_NAMES = ("ttft", "tpot", "e2el")


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    base_url: str
    workload: WorkloadConfig = WorkloadConfig()
    endpoint: str = "/v1/completions"
    model: str | None = None  # None: the first model the server lists at /v1/models
    headers: Mapping[str, str] = dataclasses.field(default_factory=dict)
    request_timeout_s: float = 600.0
    num_processes: int = 1
    max_concurrency: int | None = None
    ignore_eos: bool = False
    temperature: float = 0.0
    max_tokens_field: str = "max_tokens"
    extra_body: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    tokenizer: str | None = None  # None: the one the server's model card names, if found
    prompt_format: str = "text"  # or token-ids
    percentile_metrics: tuple[str, ...] = METRIC_NAMES
    metric_percentiles: tuple[float, ...] = (99.0,)
    goodput_slos_ms: Mapping[str, float] = dataclasses.field(default_factory=dict)
    label: str | None = None

    def __post_init__(self) -> None:
        """Messages name the CLI flag of each field (config_from_args fills them from flags)."""
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(
                f"--base-url must start with http:// or https://, got {self.base_url!r}"
            )
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"unsupported --endpoint {self.endpoint}; use one of {ENDPOINTS}")
        if not self.request_timeout_s > 0:  # inf is no timeout; NaN fails this too
            raise ValueError(
                f"--request-timeout must be > 0 (or inf), got {self.request_timeout_s}"
            )
        if self.num_processes < 1:
            raise ValueError(f"--num-client-processes must be >= 1, got {self.num_processes}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"--temperature must be finite and >= 0, got {self.temperature}")
        if self.max_tokens_field not in ("max_tokens", "max_completion_tokens"):
            raise ValueError(f"unknown --max-tokens-field {self.max_tokens_field}")
        if self.prompt_format not in ("text", "token-ids"):
            raise ValueError(f"unknown --prompt-format {self.prompt_format}; use text or token-ids")
        if self.prompt_format == "token-ids" and self.chat:
            raise ValueError(f"token-id prompts exist only on /v1/completions, got {self.endpoint}")
        try:  # every request body is this JSON: NaN and Infinity are no JSON numbers
            json.dumps(dict(self.extra_body), allow_nan=False)
        except ValueError:
            raise ValueError(
                f"--extra-body holds NaN or Infinity, which JSON has not: {dict(self.extra_body)}"
            ) from None
        for name in self.percentile_metrics:
            if name not in METRIC_NAMES:
                raise ValueError(f"unknown --percentile-metrics {name!r}; use {METRIC_NAMES}")
        for p in self.metric_percentiles:
            if not 0 < p < 100:
                raise ValueError(f"--metric-percentiles must be in (0, 100), got {p}")
        for name, slo in self.goodput_slos_ms.items():
            if name not in GOODPUT_NAMES:
                raise ValueError(
                    f"--goodput wants NAME:MS with NAME in {GOODPUT_NAMES}, got {name}"
                )
            if not (math.isfinite(slo) and slo >= 0):
                raise ValueError(
                    f"--goodput {name}: the SLO must be a number of ms >= 0, got {slo}"
                )

    @property
    def chat(self) -> bool:
        return self.endpoint == "/v1/chat/completions"

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + self.endpoint
