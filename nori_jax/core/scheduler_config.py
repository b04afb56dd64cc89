"""Scheduler limits: batch shape, token budget, prefix caching, long-prompt isolation, admission."""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_model_len: int
    page_size: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    # Prompts of at least this many tokens are "long": they wait in their own queue and their
    # prefill chunks take at most `long_prefill_token_share` of a step's token budget, so a long
    # prompt never holds back short requests (None: no isolation).
    long_prefill_threshold: int | None = None
    long_prefill_token_share: float = 0.25
    max_num_long_prefills: int = 1  # long prompts prefilled concurrently
    # Admission keeps this fraction of KV pages free for the growth of running requests.
    kv_headroom: float = 0.1
    max_num_waiting: int | None = None  # bound on queued requests; None: unbounded

    def __post_init__(self) -> None:
        for name in (
            "max_model_len",
            "page_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_num_long_prefills",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= "
                f"max_num_seqs={self.max_num_seqs} (every running sequence decodes each step)"
            )
        if self.long_prefill_threshold is not None and self.long_prefill_threshold < 1:
            raise ValueError(f"long_prefill_threshold={self.long_prefill_threshold} must be >= 1")
        if not 0.0 < self.long_prefill_token_share <= 1.0:
            raise ValueError(
                f"long_prefill_token_share={self.long_prefill_token_share} must be in (0, 1]"
            )
        if not 0.0 <= self.kv_headroom < 1.0:
            raise ValueError(f"kv_headroom={self.kv_headroom} must be in [0, 1)")
        if self.max_num_waiting is not None and self.max_num_waiting < 1:
            raise ValueError(f"max_num_waiting={self.max_num_waiting} must be >= 1 or None")

    @property
    def max_pages_per_seq(self) -> int:
        return math.ceil(self.max_model_len / self.page_size)

    @property
    def long_prefill_budget(self) -> int:
        return max(1, int(self.max_num_batched_tokens * self.long_prefill_token_share))
