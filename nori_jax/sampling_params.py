"""Per-request sampling settings, with vLLM's field names. None changes a compiled program."""

from __future__ import annotations

import dataclasses

# Logprob of the sampled token is the only logprob the step returns (one number per row).
MAX_LOGPROBS = 1


@dataclasses.dataclass
class SamplingParams:
    """How one request samples and when it stops.

    temperature 0 is greedy. top_k 0 or -1 disables top-k; top_p 1.0 disables top-p. `seed` makes a
    request's sampled tokens reproducible whatever else runs beside it. `logprobs` (0 or 1) returns
    the log-probability of each sampled token under the model's unscaled distribution.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r} must be an integer >= 1")
        if not 0.0 <= self.temperature:
            raise ValueError(f"temperature={self.temperature!r} must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(
                f"top_k={self.top_k!r} must be 0 or -1 (disabled) or a positive integer"
            )
        if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed < 2**31):
            raise ValueError(f"seed={self.seed!r} must be an integer in [0, 2**31)")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(
                f"logprobs={self.logprobs!r} must be 0 or {MAX_LOGPROBS} (sampled token only)"
            )
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop={self.stop!r} must hold non-empty strings")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or t < 0:
                raise ValueError(f"stop_token_ids={self.stop_token_ids!r} must hold token ids >= 0")
