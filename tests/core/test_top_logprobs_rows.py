"""Top logprobs travel in fixed places (TOP_LOGPROBS_ROWS per step, TOP_LOGPROBS pairs each):
the plan lists the sampling rows of the requests that asked (logprobs >= 1) in place order, the
update hands each place's pairs to its row's request (its own k of them), and the scheduler admits
such a request only while a place is free, letting the others go past."""

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

from nori_jax.core.step_layout import TOP_LOGPROBS, TOP_LOGPROBS_ROWS


def test_the_plan_lists_the_sampling_rows_that_asked_in_place_order():
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
    places = plan.layout.view(plan.buffer, "top_rows")
    assert places[:2].tolist() == out.top_rows.tolist()
    assert (places[2:] == s.config.max_num_seqs).all()  # unused: dropped by the host

    # Place p's pairs: token ids 1000 p + j, logprobs -j; each request takes its own k.
    ids = 1000 * np.arange(TOP_LOGPROBS_ROWS)[:, None] + np.arange(TOP_LOGPROBS)
    values = -np.arange(TOP_LOGPROBS, dtype=np.float32)[None, :].repeat(TOP_LOGPROBS_ROWS, 0)
    assert "long" in names  # scheduled, but its chunk ends before its prompt does
    tokens = FakeDevice(s).execute(plan)
    update = s.update(out, tokens, np.zeros(len(tokens), np.float32), (ids, values))
    assert update.top_logprobs == {
        "three": [[(0, 0.0), (1, -1.0), (2, -2.0)]],
        "twenty": [[(1000 + j, -float(j)) for j in range(TOP_LOGPROBS)]],
    }
    assert reqs[2].output_top_logprobs == update.top_logprobs["three"]
    s.check_invariants()


def test_requests_past_the_places_wait_and_the_rest_go_by():
    extra = 3
    s = make_scheduler(
        num_pages=512, max_num_seqs=TOP_LOGPROBS_ROWS + 8, max_num_batched_tokens=2048
    )
    asking = [
        make_request(f"t{i}", [10 + i] * 12, 4, logprobs=1 + i % TOP_LOGPROBS)
        for i in range(TOP_LOGPROBS_ROWS + extra)
    ]
    plain = [make_request(f"p{i}", [200 + i] * 12, 4, logprobs=0) for i in range(2)]
    for r in asking + plain:
        s.add_request(r)
    out = s.schedule()
    running = {r.request_id for r in out.row_requests}
    assert running == {f"t{i}" for i in range(TOP_LOGPROBS_ROWS)} | {"p0", "p1"}
    assert [r.request_id for r in s.waiting] == [f"t{TOP_LOGPROBS_ROWS + i}" for i in range(extra)]
    assert len(out.top_rows) == TOP_LOGPROBS_ROWS
    # (building a plan raises if the step had more rows asking than places)
    most = finish_counting(s, out, lambda running: sum(bool(r.params.logprobs) for r in running))
    assert most == TOP_LOGPROBS_ROWS
    for r in asking + plain:
        assert r.output_token_ids == expected_output(r.prompt_token_ids, 4), r.request_id
    assert s.allocator.num_used_pages == 0
