"""Drive the Scheduler without a model: tokens are a deterministic function of the sequence."""

from __future__ import annotations

import numpy as np

from nori_jax.paging import PageAllocator
from nori_jax.request import Request
from nori_jax.sampling_params import SamplingParams
from nori_jax.scheduler import Scheduler
from nori_jax.scheduler_config import SchedulerConfig
from nori_jax.step_plan import StepPlan


def next_token(tokens: list[int]) -> int:
    """What the fake model 'predicts' after a sequence: depends on the whole sequence only."""
    return (sum(tokens) * 31 + len(tokens)) % 1000 + 3


def make_scheduler(num_pages: int = 64, **overrides) -> Scheduler:
    cfg = dict(max_model_len=256, page_size=16, max_num_seqs=8, max_num_batched_tokens=64)
    cfg.update(overrides)
    config = SchedulerConfig(**cfg)
    return Scheduler(config, PageAllocator(num_pages, config.page_size, config.enable_prefix_caching))


def make_request(rid: str, prompt: list[int], max_tokens: int = 8, **params) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0, **params),
                   seed=0)


def check_plan(s: Scheduler, plan: StepPlan) -> None:
    """Every plan sits in a bucket, respects the budget, lists decodes first, and its token and
    slot arrays agree with the requests' pages."""
    assert plan.bucket in s.buckets and plan.num_tokens <= plan.bucket
    assert plan.num_tokens <= s.config.max_num_batched_tokens
    assert plan.num_rows <= s.config.max_num_seqs
    n = plan.num_scheduled_tokens
    first_prefill = next((i for i, k in enumerate(n) if k != 1), len(n))
    assert all(k == 1 for k in n[:first_prefill]) and all(k != 1 for k in n[first_prefill:])
    assert plan.distribution.tolist() == [first_prefill, plan.num_rows]
    assert plan.cu_q_lens[plan.num_rows] == plan.num_tokens
    assert (plan.slot_mapping[plan.num_tokens :] == 0).all()  # padding writes go to page 0
    ps = s.page_size
    for i, rid in enumerate(plan.request_ids):
        req = s.requests[rid]
        lo, hi = plan.cu_q_lens[i], plan.cu_q_lens[i + 1]
        pos = plan.positions[lo:hi]
        start = req.num_computed_tokens
        assert pos.tolist() == list(range(start, start + hi - lo))
        assert plan.input_ids[lo:hi].tolist() == req.token_ids(start, start + hi - lo)
        assert plan.kv_lens[i] == start + hi - lo
        pages = np.asarray(req.pages)
        assert (plan.slot_mapping[lo:hi] == pages[pos // ps] * ps + pos % ps).all()
        assert (plan.slot_mapping[lo:hi] >= ps).all(), "a real token writes into the null page"


def fake_step(s: Scheduler, plan: StepPlan) -> list[Request]:
    """Sample what the fake model predicts for each row that samples, then update."""
    tokens = np.zeros(s.config.max_num_seqs, np.int32)
    for i, (rid, samples) in enumerate(zip(plan.request_ids, plan.samples, strict=True)):
        if samples:
            req = s.requests[rid]
            tokens[i] = next_token(req.token_ids(0, req.num_tokens))
    return s.update(plan, tokens, np.zeros(s.config.max_num_seqs, np.float32))


def run_to_completion(s: Scheduler, requests: list[Request], max_steps: int = 10_000,
                      on_step=None) -> dict[str, Request]:
    for r in requests:
        s.add_request(r)
    done: dict[str, Request] = {}
    for _ in range(max_steps):
        plan = s.schedule()
        s.check_invariants()
        if plan is None:
            break
        check_plan(s, plan)
        if on_step:
            on_step(s, plan)
        for req in fake_step(s, plan):
            if req.is_finished:
                done[req.request_id] = req
        s.check_invariants()
    assert not s.has_unfinished(), "scheduler stopped making progress"
    assert s.allocator.num_used_pages == 0, "pages leaked"
    return done


def expected_output(prompt: list[int], max_tokens: int) -> list[int]:
    seq = list(prompt)
    for _ in range(max_tokens):
        seq.append(next_token(seq))
    return seq[len(prompt):]
