"""The priority scheduling policy (vLLM's `--scheduling-policy priority`): waiting requests are
admitted by (priority, arrival), lower first; when pages run out the running request of the
largest (priority, arrival) is preempted, and preempted requests wait in that order too. Outputs
stay exact, and FCFS (the default) is unchanged by any of it."""

from __future__ import annotations

import numpy as np
import pytest
from fake_runner import (
    expected_output,
    fake_step,
    make_request,
    make_scheduler,
    run_to_completion,
)

from nori_jax.core.engine_core import EngineCore, EngineCoreRequest, check_priority
from nori_jax.sampling_params import ParameterError, SamplingParams


def _prioritized(rid: str, prompt: list[int], max_tokens: int, priority: int):
    req = make_request(rid, prompt, max_tokens)
    req.priority = priority
    return req


def test_waiting_requests_are_admitted_by_priority_then_arrival():
    s = make_scheduler(num_pages=64, max_num_seqs=2, scheduling_policy="priority")
    reqs = [
        _prioritized("late-low", [5] * 8, 4, 5),
        _prioritized("urgent", [6] * 8, 4, -3),
        _prioritized("normal-1", [7] * 8, 4, 0),
        _prioritized("normal-2", [8] * 8, 4, 0),
    ]
    admitted = []

    def on_step(s, plan):
        for r in plan.scheduled.row_requests:
            if r.request_id not in admitted:
                admitted.append(r.request_id)

    done = run_to_completion(s, reqs, on_step=on_step)
    assert admitted == ["urgent", "normal-1", "normal-2", "late-low"]
    for r in reqs:
        assert done[r.request_id].output_token_ids == expected_output(r.prompt_token_ids, 4)


def test_fcfs_admits_in_arrival_order_whatever_the_priority_field():
    s = make_scheduler(num_pages=64, max_num_seqs=2)
    reqs = [_prioritized(f"r{i}", [5 + i] * 8, 4, 0) for i in range(4)]
    admitted = []
    run_to_completion(
        s,
        reqs,
        on_step=lambda s, plan: admitted.extend(
            r.request_id for r in plan.scheduled.row_requests if r.request_id not in admitted
        ),
    )
    assert admitted == ["r0", "r1", "r2", "r3"]


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_the_victim_is_the_largest_rank_not_the_newest(policy):
    """B (priority 5 under the priority policy) runs alone; A and C (0 and 1) arrive, fill the
    pool, and their first decodes need pages: the priority policy preempts B, the oldest; FCFS
    preempts the newest, C."""
    s = make_scheduler(num_pages=5, max_model_len=48, kv_headroom=0.0, scheduling_policy=policy)
    ranked = policy == "priority"
    b = _prioritized("B", [6] * 16, 6, 5 if ranked else 0)
    s.add_request(b)
    fake_step(s, s.schedule())  # B prefilled, its first token out
    preempted = []
    original = s._preempt
    s._preempt = lambda victim: (preempted.append(victim.request_id), original(victim))
    a, c = _prioritized("A", [5] * 16, 6, 0), _prioritized("C", [7] * 16, 6, 1 if ranked else 0)
    done = run_to_completion(s, [a, c])
    assert preempted[0] == ("B" if ranked else "C")
    for r in (a, c):
        assert done[r.request_id].output_token_ids == expected_output(r.prompt_token_ids, 6)
    assert b.output_token_ids == expected_output(b.prompt_token_ids, 6)


@pytest.mark.parametrize("overlap", [False, True])
def test_preemption_under_priorities_keeps_outputs_exact(overlap):
    """A pool far too small for the batch, three priority levels: the waiting queues stay in
    rank order (check_invariants), the high-priority requests are preempted least, and every
    output is exact."""
    rng = np.random.default_rng(5)
    reqs = [
        _prioritized(
            f"r{i}", rng.integers(3, 900, int(rng.integers(20, 60))).tolist(), 40, [1, 0, 2][i % 3]
        )
        for i in range(18)
    ]
    s = make_scheduler(
        num_pages=20, max_model_len=128, kv_headroom=0.0, scheduling_policy="priority"
    )
    done = run_to_completion(s, reqs, overlap=overlap)
    assert s.counters.num_preemptions > 0
    by_priority = {p: sum(r.num_preemptions for r in reqs if r.priority == p) for p in (0, 1, 2)}
    assert by_priority[0] < by_priority[2], by_priority
    for r in reqs:
        assert done[r.request_id].output_token_ids == expected_output(r.prompt_token_ids, 40)


def test_a_priority_under_fcfs_is_refused_by_name():
    check_priority(0, "fcfs")
    check_priority(-(2**31), "priority")
    with pytest.raises(ParameterError, match="scheduling_policy='priority'") as e:
        check_priority(3, "fcfs")
    assert e.value.param == "priority"
    for bad in (2**31, True, 1.5):
        with pytest.raises(ParameterError, match="32-bit integer"):
            check_priority(bad, "priority")
    s = make_scheduler(num_pages=64)
    core = EngineCore(s, s._builder, executor=None)
    request = EngineCoreRequest("x", [5, 6], SamplingParams(max_tokens=2), 0, [], 0.0, priority=1)
    with pytest.raises(ParameterError, match="priority"):
        core.add_request(request)
    assert not s.has_unfinished()


def test_running_prefills_take_the_budget_by_rank():
    """A long low-priority prompt (L, admitted first, prefilling within its long-prompt share)
    and a short urgent one (H) prefill side by side: under the priority policy H's chunks take
    the step's budget first, so its first token comes earlier than under FCFS."""

    def first_token_step(policy: str) -> int:
        s = make_scheduler(
            num_pages=64,
            max_num_batched_tokens=48,
            long_prefill_threshold=100,
            long_prefill_token_share=0.5,
            scheduling_policy=policy,
        )
        low = _prioritized("L", list(range(3, 203)), 2, 5 if policy == "priority" else 0)
        high = _prioritized("H", list(range(300, 380)), 2, 0)
        s.add_request(low)
        fake_step(s, s.schedule())
        s.add_request(high)
        for step in range(1, 50):
            fake_step(s, s.schedule())
            if high.output_token_ids:
                return step
        raise AssertionError("H never produced a token")

    assert first_token_step("priority") < first_token_step("fcfs")
