"""Top logprobs (TOP_LOGPROBS pairs per listed row): the plan lists the sampling rows of the
requests that asked (logprobs >= 1) in row order, the update hands each listed row's pairs to its
request (its own k of them), and any number of such requests run at once (an earlier form held
64 places and made the others wait: a quarter of 2,000 requests asking cost 38% of throughput)."""

from __future__ import annotations

import numpy as np
from fake_runner import (
    FakeDevice,
    build,
    expected_output,
    finish_counting,
    make_request,
    make_scheduler,
)

from nori_jax.core.step_layout import TOP_LOGPROBS


def test_the_plan_lists_the_sampling_rows_that_asked_in_row_order():
    s = make_scheduler(num_pages=64, max_num_seqs=6, max_num_batched_tokens=64)
    reqs = [
        make_request("none", [5] * 10, 2),
        make_request("zero", [6] * 10, 2, logprobs=0),  # the sampled token's logprob only
        make_request("three", [7] * 10, 2, logprobs=3),
        make_request("twenty", [9] * 10, 2, logprobs=TOP_LOGPROBS),
        make_request("long", [8] * 80, 2, logprobs=5),  # its first chunk samples nothing
    ]
    for r in reqs:
        s.add_request(r)
    out = s.schedule()
    plan = build(s, out)
    names = [r.request_id for r in out.row_requests]
    assert [names[i] for i in out.top_rows] == ["three", "twenty"]
    listed = plan.layout.view(plan.buffer, "top_rows")
    assert len(listed) == s.config.max_num_seqs
    assert listed[:2].tolist() == out.top_rows.tolist()
    assert (listed[2:] == s.config.max_num_seqs).all()  # then padding: no program reads it

    # Listed row p's pairs: token ids 1000 p + j, logprobs -j; each request takes its own k.
    ids = 1000 * np.arange(2)[:, None] + np.arange(TOP_LOGPROBS)
    values = -np.arange(TOP_LOGPROBS, dtype=np.float32)[None, :].repeat(2, 0)
    assert "long" in names  # scheduled, but its chunk ends before its prompt does
    tokens = FakeDevice(s).execute(plan)
    update = s.update(out, tokens, np.zeros(len(tokens), np.float32), (ids, values))
    assert update.top_logprobs == {
        "three": [[(0, 0.0), (1, -1.0), (2, -2.0)]],
        "twenty": [[(1000 + j, -float(j)) for j in range(TOP_LOGPROBS)]],
    }
    s.check_invariants()


def test_every_request_asking_runs_at_once_past_the_old_64_places():
    n = 100
    s = make_scheduler(num_pages=512, max_num_seqs=n + 4, max_num_batched_tokens=2048)
    asking = [
        make_request(f"t{i}", [10 + i] * 12, 4, logprobs=1 + i % TOP_LOGPROBS) for i in range(n)
    ]
    plain = [make_request(f"p{i}", [200 + i] * 12, 4, logprobs=0) for i in range(2)]
    for r in asking + plain:
        s.add_request(r)
    out = s.schedule()
    assert {r.request_id for r in out.row_requests} == {r.request_id for r in asking + plain}
    assert not s.waiting and len(out.top_rows) == n
    names = [r.request_id for r in out.row_requests]
    assert sorted(names[i] for i in out.top_rows) == sorted(r.request_id for r in asking)

    def check(plan):  # every later step lists every asking request still running
        want = sum(bool(r.params.logprobs) for r in s.running)
        assert len(plan.scheduled.top_rows) == want
        listed = plan.layout.view(plan.buffer, "top_rows")
        assert (listed[:want] == plan.scheduled.top_rows).all() and (listed[want:] == n + 4).all()

    most = finish_counting(
        s, out, lambda running: sum(bool(r.params.logprobs) for r in running), on_plan=check
    )
    assert most == n
    for r in asking + plain:
        assert r.output_token_ids == expected_output(r.prompt_token_ids, 4), r.request_id
    assert s.allocator.num_used_pages == 0 and not s.slots.wants_top_logprobs.any()
