"""Prompt logprobs on the host side: each prompt position whose logprob a request asks for takes
a logit row past the step's rows (`logits_indices` pointing at its token), within the rows the
step's bucket computes; every position is planned exactly once, through chunking, preemption,
overlapped steps and the prefix cache, and the values come back to the request in order."""

from __future__ import annotations

import numpy as np
import pytest
from fake_runner import (
    FakeDevice,
    build,
    check_plan,
    expected_output,
    make_request,
    make_scheduler,
    shared_prefix_requests,
)

from nori_jax.core.request import Request
from nori_jax.sampling_params import SamplingParams


class PromptDevice(FakeDevice):
    """A FakeDevice that also answers the plan's prompt-logprob rows as the jitted step would lay
    them out, with each row's position as its "logprob" and its target as its id, after checking
    the row, its token and its target."""

    def execute(self, plan):
        view = lambda name: plan.layout.view(plan.buffer, name)  # noqa: E731
        s = self.s.config.max_num_seqs
        rows, targets = view("prompt_logprob_rows"), view("prompt_logprob_targets")
        n = int((rows < s).sum())
        assert (rows[n:] == s).all(), "listed rows come first"
        computed = min(s, plan.bucket)  # the logit rows the step's bucket computes
        top = int(view("prompt_logprob_top")[0])
        ids = np.zeros((n, 1 + top), np.int32)
        values = np.zeros((n, 1 + top), np.float32)
        owners = {}
        for e in plan.scheduled.prompt_logprobs:
            for j in range(e.count):
                owners[len(owners)] = (e, e.first + j)
        assert len(owners) == n
        assert len(set(rows[:n].tolist())) == n
        for k in range(n):
            r = int(rows[k])
            assert plan.num_rows <= r < computed, "a prompt-logprob row the step does not compute"
            e, pos = owners[k]
            token = int(view("logits_indices")[r])
            assert plan.cu_q_lens[e.row] <= token < plan.cu_q_lens[e.row + 1]
            assert int(plan.positions[token]) == pos
            assert int(targets[k]) == e.request.prompt_token_ids[pos + 1]
            ids[k, 0], values[k] = pos + 1, pos  # (the target's rank, then its logprob)
        self.last_prompt = (ids, values) if n else None
        return super().execute(plan)


def run(s, requests: list[Request], overlap: bool) -> None:
    for r in requests:
        s.add_request(r)
    device = PromptDevice(s)
    s._fake = device
    in_flight = None
    for _ in range(5000):
        out = s.schedule()
        s.check_invariants()
        launched = None
        if out is not None:
            plan = build(s, out)
            check_plan(s, plan)
            launched = (out, device.execute(plan), device.last_prompt)
        finish = in_flight if overlap else launched
        in_flight = launched if overlap else None
        if finish is None and launched is None:
            break
        if finish is not None:
            s.update(finish[0], finish[1], None, None, finish[2])
        s.check_invariants()
    assert not s.has_unfinished() and s.allocator.num_used_pages == 0


def _asking(r: Request, k: int) -> Request:
    p = SamplingParams(max_tokens=r.params.max_tokens, temperature=0.0, prompt_logprobs=k)
    return Request(r.request_id, r.prompt_token_ids, p, seed=0)


@pytest.mark.parametrize("overlap", [False, True])
def test_every_position_once_in_order_through_preemption_and_the_prefix_cache(overlap):
    reqs = shared_prefix_requests(24, seed=8, max_own=50, max_tokens=(1, 40))
    reqs = [_asking(r, i % 3) if i % 2 == 0 else r for i, r in enumerate(reqs)]
    s = make_scheduler(
        num_pages=20, max_model_len=128, kv_headroom=0.0, max_num_seqs=16, max_num_batched_tokens=64
    )
    run(s, reqs, overlap)
    assert s.counters.num_preemptions > 0 and s.counters.prefix_cache_hits > 0
    for r in reqs:
        assert r.output_token_ids == expected_output(r.prompt_token_ids, r.params.max_tokens)
        if r.params.prompt_logprobs is None:
            assert r.prompt_logprobs == []
            continue
        assert r.prompt_logprobs == [float(p) for p in range(r.num_prompt_tokens - 1)]
        assert r.prompt_logprob_ranks == [p + 1 for p in range(r.num_prompt_tokens - 1)]
        if r.params.prompt_logprobs:
            assert [pairs[0][0] for pairs in r.prompt_top_logprobs] == [0] * (
                r.num_prompt_tokens - 1
            )


def test_a_chunk_wider_than_its_bucket_takes_a_larger_bucket():
    """A non-final chunk of 16 tokens (the budget of 24 cut at a page) asks for 16 positions
    besides its own row: 17 logit rows, so the step runs in the 24-token bucket though it has
    16 tokens."""
    s = make_scheduler(num_pages=64, max_num_seqs=20, max_num_batched_tokens=24)
    req = _asking(make_request("r", list(range(3, 43)), 2), 0)
    s.add_request(req)
    out = s.schedule()
    assert out.num_tokens == 16 and sum(e.count for e in out.prompt_logprobs) == 16
    plan = build(s, out)
    assert s.buckets[:2] == [16, 24] and plan.bucket == 24


def test_asking_requests_prefill_within_the_rows_a_step_spares():
    """8 rows a step: a 40-token prompt asking for its logprobs prefills 7 positions a step beside
    nothing else, fewer beside decoding rows; one not asking prefills its whole budget."""
    s = make_scheduler(num_pages=64, max_num_seqs=8, max_num_batched_tokens=64)
    asking = _asking(make_request("a", list(range(3, 43)), 2), 0)
    s.add_request(asking)
    assert s.schedule().num_tokens == 7  # its own row and 7 more: all 8
    plain = make_request("p", list(range(100, 140)), 2)
    s2 = make_scheduler(num_pages=64, max_num_seqs=8, max_num_batched_tokens=64)
    s2.add_request(plain)
    assert s2.schedule().num_tokens == 40


def test_prompt_logprobs_need_a_spare_row():
    from nori_jax.core.engine_core import EngineCore, EngineCoreRequest
    from nori_jax.sampling_params import ParameterError

    s = make_scheduler(num_pages=64, max_num_seqs=1, max_num_batched_tokens=64)
    core = EngineCore(s, s._builder, executor=None)
    params = SamplingParams(max_tokens=2, prompt_logprobs=0)
    with pytest.raises(ParameterError, match="max_num_seqs >= 2") as e:
        core.add_request(EngineCoreRequest("x", [5, 6, 7], params, 0, [], 0.0))
    assert e.value.param == "prompt_logprobs" and not s.has_unfinished()
