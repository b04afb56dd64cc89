"""Scheduler limits: batch shape, token budget, context, prefix caching, isolation, admission.

Declared once: `EngineConfig.scheduler` holds one, presets and `LLM(...)` set its fields by their
flat names (`max_num_seqs=...`), and `engine_args.py` makes a flag of each field.
"""

from __future__ import annotations

import dataclasses
import logging
import math

from nori_jax.config_field import check_types, option

logger = logging.getLogger(__name__)
# max_model_len=None: the model's own limit, but at most this (a longer context costs KV pages
# and page-table width for every sequence).
DEFAULT_MAX_MODEL_LEN = 8192
# A multi-step launch returns [K, max_num_seqs] samples and holds new arrivals for K steps; past a
# few dozen steps it only adds latency (the host's share is already amortized).
MAX_SCHEDULER_STEPS = 64
SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_model_len: int | None = option(
        None,
        help="tokens per sequence, prompt and output; none: the model's limit, at most "
        f"{DEFAULT_MAX_MODEL_LEN}",
    )
    clamp_max_model_len: bool = option(
        False,
        help="clamp max_model_len to the model's limit instead of failing (a preset's own "
        "max_model_len is always clamped)",
    )
    page_size: int = option(
        64, help="tokens per KV page (a power of two)", flags=("--page-size", "--block-size")
    )
    max_num_seqs: int = option(256, help="sequences in one step: the rows of every bucket")
    max_num_batched_tokens: int = option(
        4096,
        help="token budget of one step; the buckets are powers of two from 16 up to it",
    )
    enable_prefix_caching: bool = option(
        True,
        help="reuse the KV pages of a prompt prefix already computed",
        flags=("--enable-prefix-caching", "--prefix-caching"),
    )
    wait_for_shared_prefix: bool = option(
        True,
        help="a waiting request whose next prompt page a running request is computing waits "
        "for that page to reach the prefix cache instead of computing a copy (n > 1, bursts "
        "with one system prompt): less prefill and fewer pages for a step of TTFT",
    )
    long_prefill_threshold: int | None = option(
        None,
        help="prompts of at least this many tokens wait in their own queue and prefill within "
        "--long-prefill-token-share of each step (none or 0: no isolation)",
    )
    long_prefill_token_share: float = option(
        0.25, help="share of a step's token budget that long prompts' prefill may take"
    )
    max_num_long_prefills: int = option(1, help="long prompts prefilled concurrently")
    kv_headroom: float = option(
        0.1, help="fraction of KV pages admission keeps free for running requests' growth"
    )
    max_num_waiting: int | None = option(
        None,
        help="bound on queued requests; one more is refused (HTTP 429); none: unbounded",
    )
    scheduling_policy: str = option(
        "fcfs",
        help="fcfs: first come, first served; priority: by each request's priority (lower "
        "first), then arrival, and the lowest priority is preempted first",
        choices=SCHEDULING_POLICIES,
    )
    num_scheduler_steps: int = option(
        1,
        help="decode steps per launch (multi-step decode) while every running request decodes, "
        "none waits and at most --multi-step-max-seqs run; 1: one step per launch",
    )
    multi_step_max_seqs: int = option(
        64,
        help="the most running sequences a multi-step launch holds (its programs are compiled "
        "for the token buckets up to this size)",
    )

    def __post_init__(self) -> None:
        check_types(self)
        if self.long_prefill_threshold == 0:  # the flag's "off" value
            object.__setattr__(self, "long_prefill_threshold", None)
        for name in (
            "page_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_num_long_prefills",
            "num_scheduler_steps",
            "multi_step_max_seqs",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.num_scheduler_steps > MAX_SCHEDULER_STEPS:
            raise ValueError(
                f"num_scheduler_steps={self.num_scheduler_steps} must be at most "
                f"{MAX_SCHEDULER_STEPS}"
            )
        if self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size={self.page_size} must be a power of two")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len={self.max_model_len} must be >= 2")
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
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy={self.scheduling_policy!r} must be one of {SCHEDULING_POLICIES}"
            )
        if self.max_num_waiting is not None and self.max_num_waiting < 1:
            raise ValueError(f"max_num_waiting={self.max_num_waiting} must be >= 1 or None")

    def for_model(self, model_limit: int) -> SchedulerConfig:
        """This config with max_model_len resolved against the model's position limit.

        None takes the limit (at most DEFAULT_MAX_MODEL_LEN); a value above the limit is an error
        unless `clamp_max_model_len` (presets set it for their own value) clamps it.
        """
        want = self.max_model_len
        if want is None:
            resolved = min(model_limit, DEFAULT_MAX_MODEL_LEN)
        elif want <= model_limit:
            resolved = want
        elif self.clamp_max_model_len:
            logger.info(
                "max_model_len %d clamped to the model's limit of %d positions", want, model_limit
            )
            resolved = model_limit
        else:
            raise ValueError(
                f"max_model_len={want} exceeds the model's limit of {model_limit} positions"
            )
        return dataclasses.replace(self, max_model_len=resolved)

    @property
    def max_pages_per_seq(self) -> int:
        assert self.max_model_len is not None, "resolve max_model_len first (for_model)"
        return math.ceil(self.max_model_len / self.page_size)

    @property
    def long_prefill_budget(self) -> int:
        return max(1, int(self.max_num_batched_tokens * self.long_prefill_token_share))
