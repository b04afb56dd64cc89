"""Requests that share a prompt prefix with a running prefill wait for its pages instead of
computing copies (`wait_for_shared_prefix`): n > 1 sampling, a burst with one system prompt."""

from __future__ import annotations

import pytest
from fake_runner import expected_output, fake_step, make_request, make_scheduler, run_to_completion

PROMPT = list(range(100, 170))  # four full 16-token pages and 6 tokens more


def _computed_tokens(s, reqs, **kw) -> tuple[dict, int]:
    """Run to completion; the prompt tokens the steps computed (prefill work), summed: every
    scheduled token but the decodes' (a request's outputs after its first)."""
    scheduled = []
    done = run_to_completion(
        s, reqs, on_step=lambda s, plan: scheduled.extend(plan.num_scheduled_tokens), **kw
    )
    return done, sum(scheduled) - sum(r.params.max_tokens - 1 for r in reqs)


def _prefill_ids(out) -> list[str]:
    return [r.request_id for r in out.row_requests[len(out.decode_slots) :]]


@pytest.mark.parametrize("overlap", [False, True])
def test_copies_of_one_prompt_compute_its_pages_once(overlap):
    reqs = [make_request(f"c{i}", PROMPT, 5) for i in range(4)]
    s = make_scheduler(num_pages=64, max_num_batched_tokens=256)
    done, work = _computed_tokens(s, reqs, overlap=overlap)
    # the first computes all 70 tokens; each other one only the 6 past the shared pages
    assert work == 70 + 3 * 6
    assert s.counters.prefix_cache_hits == 3 * 64
    for r in reqs:
        assert done[r.request_id].output_token_ids == expected_output(PROMPT, 5)


def test_without_waiting_every_copy_computes_the_whole_prompt():
    reqs = [make_request(f"c{i}", PROMPT, 5) for i in range(4)]
    s = make_scheduler(num_pages=64, max_num_batched_tokens=256, wait_for_shared_prefix=False)
    done, work = _computed_tokens(s, reqs)
    assert work == 4 * 70 and s.counters.prefix_cache_hits == 0
    for r in reqs:
        assert done[r.request_id].output_token_ids == expected_output(PROMPT, 5)


def test_a_waiting_copy_lets_the_requests_behind_it_in():
    s = make_scheduler(num_pages=64, max_num_batched_tokens=256)
    for rid, prompt in (("first", PROMPT), ("copy", PROMPT), ("other", [5] * 20)):
        s.add_request(make_request(rid, prompt, 3))
    out = s.schedule()
    assert _prefill_ids(out) == ["first", "other"]
    assert [r.request_id for r in s.waiting] == ["copy"]
    fake_step(s, out)  # the first's pages are published
    out = s.schedule()
    assert _prefill_ids(out) == ["copy"]
    assert s.requests["copy"].num_cached_tokens == 64
    s.check_invariants()


def test_a_copy_follows_a_chunked_prefill_page_by_page():
    """Behind a prompt prefilled in chunks, a copy waits until every shared page is published,
    then computes only its tail."""
    prompt = list(range(1000, 1100))  # six full pages and 4 tokens
    reqs = [make_request("first", prompt, 3), make_request("copy", prompt, 3)]
    s = make_scheduler(num_pages=64, max_num_batched_tokens=32)
    done, work = _computed_tokens(s, reqs)
    assert work == 100 + 4
    assert done["copy"].num_cached_tokens == 96
    assert done["copy"].output_token_ids == expected_output(prompt, 3)


def test_a_preempted_prefill_releases_the_requests_waiting_on_it():
    """The running request whose pages a copy waits for leaves the batch: the copy is admitted
    and computes what it must, and nothing hangs."""
    s = make_scheduler(num_pages=64, max_num_batched_tokens=32)
    s.add_request(make_request("first", PROMPT, 3))
    s.add_request(make_request("copy", PROMPT, 3))
    fake_step(s, s.schedule())  # "first" computed 32 tokens (two pages); "copy" waits
    assert [r.request_id for r in s.waiting] == ["copy"]
    s.finish_request("first", "abort")
    out = s.schedule()
    assert _prefill_ids(out) == ["copy"]
    assert s.requests["copy"].num_cached_tokens == 32  # the two pages "first" published
    fake_step(s, out)
    s.check_invariants()
