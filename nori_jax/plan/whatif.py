"""The simulated engine: the calibrated engine's settings, with the what-if levers applied.

Scheduling levers (page size, KV pool, headroom, sequences, chunk budget, prefix caching,
long-prompt isolation, queue bound, overlapped scheduling) change what the real scheduler
decides; the step model stays the calibration's. Where a lever reaches outside what the
profiles measured, the planner says so (`warnings`) instead of pretending: the attention kernel
was timed at the calibrated page size, and the sampler and logits at the calibrated number of
sequences.
"""

from __future__ import annotations

import dataclasses

from nori_jax.core.scheduler_config import SchedulerConfig
from nori_jax.plan.calibration import Calibration
from nori_jax.plan.simulator import SimEngine

# The most KV pages simulated: the allocator holds Python state per page (2**24 pages of 16
# tokens are 268M tokens, far beyond any device's pool).
MAX_NUM_PAGES = 2**24


@dataclasses.dataclass(frozen=True)
class WhatIf:
    """None keeps the calibrated engine's value (or the scheduler's default)."""

    page_size: int | None = None
    num_pages: int | None = None
    kv_headroom: float | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None  # the chunk budget: tokens per step
    max_model_len: int | None = None
    enable_prefix_caching: bool | None = None
    long_prefill_threshold: int | None = None  # 0: no isolation
    long_prefill_token_share: float | None = None
    max_num_long_prefills: int | None = None
    max_num_waiting: int | None = None
    async_scheduling: bool | None = None
    num_scheduler_steps: int | None = None  # multi-step decode (composed from single steps)
    multi_step_max_seqs: int | None = None

    def __post_init__(self) -> None:
        ps = self.page_size
        if ps is not None and (ps < 1 or ps & (ps - 1)):
            raise ValueError(f"page_size={ps} must be a power of two")


def sim_engine(cal: Calibration, w: WhatIf = WhatIf()) -> tuple[SimEngine, list[str]]:
    """The engine to simulate and the caveats of the levers pulled."""
    e = cal.engine
    pick = lambda v, default: default if v is None else v  # noqa: E731
    page_size = pick(w.page_size, e.page_size)
    defaults = SchedulerConfig(max_model_len=e.max_model_len, page_size=page_size)
    threshold = w.long_prefill_threshold or None
    scheduler = SchedulerConfig(
        max_model_len=pick(w.max_model_len, e.max_model_len),
        page_size=page_size,
        max_num_seqs=pick(w.max_num_seqs, e.max_num_seqs),
        max_num_batched_tokens=pick(w.max_num_batched_tokens, e.max_num_batched_tokens),
        enable_prefix_caching=pick(w.enable_prefix_caching, defaults.enable_prefix_caching),
        long_prefill_threshold=threshold,
        long_prefill_token_share=pick(
            w.long_prefill_token_share, defaults.long_prefill_token_share
        ),
        max_num_long_prefills=pick(w.max_num_long_prefills, defaults.max_num_long_prefills),
        kv_headroom=pick(w.kv_headroom, defaults.kv_headroom),
        max_num_waiting=w.max_num_waiting,
        num_scheduler_steps=pick(w.num_scheduler_steps, defaults.num_scheduler_steps),
        multi_step_max_seqs=pick(w.multi_step_max_seqs, defaults.multi_step_max_seqs),
    )
    num_pages = pick(w.num_pages, cal.kv_pages(page_size))
    if not 2 <= num_pages <= MAX_NUM_PAGES:
        raise ValueError(
            f"--num-pages {num_pages} must be >= 2 (page 0 is reserved) and <= {MAX_NUM_PAGES:,} "
            f"(the simulated allocator keeps state per page; the calibrated pool is "
            f"{cal.kv_pages(page_size):,} pages of {page_size} tokens)"
        )
    engine = SimEngine(
        scheduler, num_pages, e.vocab_size, pick(w.async_scheduling, e.async_scheduling)
    )
    warnings = []
    if page_size != e.page_size:
        warnings.append(
            f"page size {page_size}: device times were profiled at page size {e.page_size} "
            "(the attention kernel's speed at another page size is not calibrated)"
        )
    if scheduler.max_num_seqs != e.max_num_seqs:
        warnings.append(
            f"max_num_seqs {scheduler.max_num_seqs}: profiled at {e.max_num_seqs}; the per-step "
            "cost of the logits and sampler over every sequence slot is the profiled one"
        )
    if scheduler.max_model_len > e.max_model_len:
        warnings.append(
            f"max_model_len {scheduler.max_model_len} is above the profiled {e.max_model_len}"
        )
    if scheduler.num_scheduler_steps > 1:
        warnings.append(
            f"num_scheduler_steps {scheduler.num_scheduler_steps}: a multi-step launch is "
            "modelled as its steps' device times back to back for one launch's host costs (the "
            "calibration profiles single steps; not validated against a measured run)"
        )
    return engine, warnings
