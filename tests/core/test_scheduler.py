"""Scheduler behaviour with a fake runner; invariants are checked after every step."""

from __future__ import annotations

import numpy as np
import pytest
from fake_runner import (
    expected_output,
    make_request,
    make_scheduler,
    run_to_completion,
    shared_prefix_requests,
)

from nori_jax.core.scheduler import QueueFullError


def _random_requests(n: int, seed: int, max_prompt: int = 120, max_out: int = 20):
    rng = np.random.default_rng(seed)
    return [
        make_request(
            f"r{i}",
            rng.integers(3, 900, rng.integers(1, max_prompt)).tolist(),
            int(rng.integers(1, max_out)),
        )
        for i in range(n)
    ]


def test_all_requests_finish_with_exact_tokens_and_no_leaks():
    reqs = _random_requests(40, seed=0)
    done = run_to_completion(make_scheduler(num_pages=96), reqs)
    for r in reqs:
        assert done[r.request_id].output_token_ids == expected_output(
            r.prompt_token_ids, r.params.max_tokens
        )
        assert done[r.request_id].finish_reason == "length"


def test_finished_request_frees_pages_and_waiting_joins_next_step():
    s = make_scheduler(num_pages=64, max_num_seqs=1)
    s.add_request(make_request("a", [5] * 20, max_tokens=2))
    s.add_request(make_request("b", [6] * 20, max_tokens=2))
    from fake_runner import fake_step

    steps = []
    while s.has_unfinished():
        plan = s.schedule()
        steps.append(plan.request_ids)
        fake_step(s, plan)
        s.check_invariants()
    assert steps == [["a"], ["a"], ["b"], ["b"]]
    assert s.allocator.num_used_pages == 0


def test_fcfs_admission_order():
    s = make_scheduler(num_pages=64, max_num_seqs=2, max_num_batched_tokens=64)
    order = []

    def record(s, plan):
        for rid in plan.request_ids:
            if rid not in order:
                order.append(rid)

    reqs = [make_request(f"r{i}", [7 + i] * 30, 3) for i in range(6)]
    run_to_completion(s, reqs, on_step=record)
    assert order == [r.request_id for r in reqs]


def test_chunked_prefill_splits_long_prompt_page_aligned_and_decodes_continue():
    s = make_scheduler(num_pages=64, max_num_batched_tokens=40)
    short = make_request("short", [3] * 5, max_tokens=30)
    long = make_request("long", list(range(10, 210)), max_tokens=2)
    chunks = []

    def record(s, plan):
        for rid, n in zip(plan.request_ids, plan.num_scheduled_tokens, strict=True):
            if rid == "long":
                chunks.append((s.requests["long"].num_computed_tokens - n, n))  # advanced already
        if "long" in plan.request_ids and s.requests.get("short") is not None:
            # the short request keeps decoding in every step the long prompt is prefilled
            assert "short" in plan.request_ids

    s.add_request(short)
    run_to_completion(s, [long], on_step=record)
    assert sum(n for _, n in chunks if _ < 200) >= 200
    for start, n in chunks[:-2]:
        assert (start + n) % 16 == 0, "chunk does not end on a page boundary"


def test_budget_smaller_than_a_page_still_progresses():
    reqs = _random_requests(6, seed=3, max_prompt=60)
    done = run_to_completion(
        make_scheduler(num_pages=64, max_num_batched_tokens=8, max_num_seqs=4), reqs
    )
    assert len(done) == 6


def test_preemption_keeps_outputs_identical_and_is_counted():
    reqs = _random_requests(24, seed=1, max_prompt=60, max_out=40)
    s = make_scheduler(num_pages=20, max_model_len=128, kv_headroom=0.0)  # 19 usable pages
    done = run_to_completion(s, reqs)
    assert s.counters.num_preemptions > 0
    for r in reqs:
        assert done[r.request_id].output_token_ids == expected_output(
            r.prompt_token_ids, r.params.max_tokens
        )


def test_prefix_cache_hits_for_shared_system_prompt_and_refcounts():
    system = list(range(100, 164))  # four full pages
    reqs = [make_request(f"r{i}", system + [900 + i, 901], 4) for i in range(5)]
    s = make_scheduler(num_pages=64, max_num_seqs=1)
    done = run_to_completion(s, reqs)
    assert s.counters.prefix_cache_hits == 4 * 64  # every request after the first hits 64 tokens
    for r in reqs:
        assert done[r.request_id].output_token_ids == expected_output(r.prompt_token_ids, 4)


def test_shared_pages_have_refcount_per_holder():
    system = list(range(100, 132))  # two full pages
    s = make_scheduler(num_pages=64, max_num_seqs=4)
    from fake_runner import fake_step

    s.add_request(make_request("a", system + [1], 10))
    fake_step(s, s.schedule())
    s.add_request(make_request("b", system + [2], 10))
    s.add_request(make_request("c", system + [3], 10))
    fake_step(s, s.schedule())
    a, b, c = (s.requests[x] for x in "abc")
    assert a.pages[:2] == b.pages[:2] == c.pages[:2]
    assert all(s.allocator.ref_counts[p] == 3 for p in a.pages[:2])
    s.check_invariants()


def test_cached_page_is_never_written():
    """A prompt that is exactly whole cached pages recomputes its last page instead of writing
    into a shared one."""
    prompt = list(range(200, 232))
    s = make_scheduler(num_pages=64)
    run_to_completion(s, [make_request("a", prompt, 2)])
    from fake_runner import fake_step

    s.add_request(make_request("b", prompt, 2))
    plan = s.schedule()
    assert plan.num_scheduled_tokens == [16]  # page 0 from cache, the last page recomputed
    fake_step(s, plan)


def test_prefix_caching_off_gives_no_hits():
    system = list(range(100, 164))
    reqs = [make_request(f"r{i}", system + [900 + i], 3) for i in range(3)]
    s = make_scheduler(num_pages=64, max_num_seqs=1, enable_prefix_caching=False)
    run_to_completion(s, reqs)
    assert s.counters.prefix_cache_hits == 0


def test_long_request_isolation_bounds_short_wait():
    """Short requests behind a very long prompt are admitted within a few steps, not after it."""

    def first_steps(threshold):
        s = make_scheduler(
            num_pages=200,
            max_model_len=2048,
            max_num_batched_tokens=64,
            long_prefill_threshold=threshold,
            long_prefill_token_share=0.25,
        )
        long = make_request("long", [4] * 1500, 2)
        shorts = [make_request(f"s{i}", [5 + i] * 10, 2) for i in range(4)]
        first_seen, step = {}, 0

        def record(s, plan):
            nonlocal step
            step += 1
            for rid in plan.request_ids:
                first_seen.setdefault(rid, step)

        s.add_request(long)
        run_to_completion(s, shorts, on_step=record)
        return max(first_seen[f"s{i}"] for i in range(4))

    assert first_steps(threshold=None) > 20  # FCFS: shorts wait for most of the long prefill
    assert first_steps(threshold=512) <= 2


def test_waiting_queue_bound_raises_queue_full():
    s = make_scheduler(max_num_waiting=2)
    s.add_request(make_request("a", [1, 2]))
    s.add_request(make_request("b", [1, 2]))
    with pytest.raises(QueueFullError):
        s.add_request(make_request("c", [1, 2]))


def test_abort_frees_pages_immediately():
    s = make_scheduler()
    from fake_runner import fake_step

    s.add_request(make_request("a", [9] * 40, 50))
    fake_step(s, s.schedule())
    assert s.allocator.num_used_pages > 0
    s.finish_request("a", "abort")
    assert s.allocator.num_used_pages == 0
    s.check_invariants()


def test_admission_keeps_kv_headroom():
    s = make_scheduler(num_pages=41, kv_headroom=0.5, max_num_seqs=8, max_num_batched_tokens=512)
    for i in range(8):
        s.add_request(make_request(f"r{i}", [10 + i] * 60, 5))  # 4 pages each
    s.schedule()
    # 40 usable pages, 20 kept free: five requests of 4 pages fit, the sixth would cut into it
    assert len(s.running) == 5
    assert s.allocator.num_free_pages == 20
    s.check_invariants()


# ---- overlapped scheduling: step N+1 is planned before step N's samples reach the host -------


def test_overlapped_scheduling_gives_the_same_tokens():
    reqs = _random_requests(40, seed=4)
    done = run_to_completion(make_scheduler(num_pages=96), reqs, overlap=True)
    for r in reqs:
        assert done[r.request_id].output_token_ids == expected_output(
            r.prompt_token_ids, r.params.max_tokens
        )


def test_overlapped_scheduling_with_preemption_and_prefix_cache():
    reqs = shared_prefix_requests(24, seed=8, max_own=50, max_tokens=(1, 40))
    s = make_scheduler(num_pages=20, max_model_len=128, kv_headroom=0.0)
    done = run_to_completion(s, reqs, overlap=True)
    assert s.counters.num_preemptions > 0 and s.counters.prefix_cache_hits > 0
    for r in reqs:
        assert done[r.request_id].output_token_ids == expected_output(
            r.prompt_token_ids, r.params.max_tokens
        )


def test_overlapped_stop_token_discards_the_in_flight_sample():
    prompt = [7, 8, 9]
    full = expected_output(prompt, 12)
    stop = full[3]
    s = make_scheduler()
    done = run_to_completion(
        s, [make_request("a", prompt, 12, stop_token_ids=[stop])], overlap=True
    )
    assert done["a"].output_token_ids == full[: full.index(stop) + 1]
    assert done["a"].finish_reason == "stop"
