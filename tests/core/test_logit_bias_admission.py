"""logit_bias entries travel in the step buffer's fixed room (LOGIT_BIAS_CAPACITY, all rows
together): the plan builder writes each biased row's entries, and the scheduler admits a request
only while the running requests' entries fit, letting the requests without entries go past."""

from __future__ import annotations

from fake_runner import (
    build,
    expected_output,
    fake_step,
    finish_counting,
    make_request,
    make_scheduler,
)

from nori_jax.core.step_layout import LOGIT_BIAS_CAPACITY
from nori_jax.sampling_params import MAX_LOGIT_BIAS


def _full_bias(offset: int) -> dict[int, float]:
    return {t: 1.0 for t in range(offset, offset + MAX_LOGIT_BIAS)}


def _entries(plan) -> list[tuple[int, int, float]]:
    view = lambda name: plan.layout.view(plan.buffer, name)  # noqa: E731
    rows, ids, values = view("bias_rows"), view("bias_tokens"), view("bias_values")
    return [(int(r), int(t), float(v)) for r, t, v in zip(rows, ids, values, strict=True) if v]


def test_the_step_carries_each_biased_rows_entries_and_forgets_a_released_slot():
    s = make_scheduler(num_pages=64, max_num_seqs=4)
    s.add_request(make_request("plain", [5] * 20, 2))
    s.add_request(make_request("biased", [6] * 20, 2, logit_bias={7: 2.5, 9: -100.0}))
    out = s.schedule()
    plan = build(s, out)
    row = [r.request_id for r in out.row_requests].index("biased")
    assert sorted(_entries(plan)) == [(row, 7, 2.5), (row, 9, -100.0)]
    fake_step(s, out)
    out = s.schedule()  # both decode their second (last) token
    assert sorted(_entries(build(s, out))) == sorted(
        (row, t, b) for t, b in ((7, 2.5), (9, -100.0))
    )
    fake_step(s, out)
    # The biased request's slot goes to a request without a bias: no entries remain.
    s.add_request(make_request("next", [8] * 20, 2))
    out = s.schedule()
    assert out is not None and _entries(build(s, out)) == []
    s.check_invariants()


def test_requests_past_the_entries_room_wait_and_the_rest_go_by():
    fit = LOGIT_BIAS_CAPACITY // MAX_LOGIT_BIAS  # requests with full biases that fit at once
    s = make_scheduler(num_pages=256, max_num_seqs=fit + 4, max_num_batched_tokens=1024)
    biased = [
        make_request(f"b{i}", [10 + i] * 20, 4, logit_bias=_full_bias(i)) for i in range(fit + 2)
    ]
    plain = [make_request(f"p{i}", [200 + i] * 20, 4) for i in range(2)]
    for r in biased + plain:
        s.add_request(r)
    out = s.schedule()
    running = {r.request_id for r in out.row_requests}
    assert running == {f"b{i}" for i in range(fit)} | {"p0", "p1"}
    assert [r.request_id for r in s.waiting] == [f"b{fit}", f"b{fit + 1}"]
    assert len(_entries(build(s, out))) == fit * MAX_LOGIT_BIAS

    def fits(plan):
        assert len(_entries(plan)) <= LOGIT_BIAS_CAPACITY

    most = finish_counting(
        s, out, lambda running: sum(bool(r.params.logit_bias) for r in running), fits
    )
    assert most == fit
    for r in biased + plain:
        assert r.output_token_ids == expected_output(r.prompt_token_ids, 4), r.request_id
    assert s.allocator.num_used_pages == 0


def test_smaller_biases_do_not_pass_one_that_waits_for_room():
    """A request waiting for logit_bias room is not starved by later requests whose smaller
    biases would fit: they wait behind it; requests without a bias still go by."""
    fit = LOGIT_BIAS_CAPACITY // MAX_LOGIT_BIAS
    s = make_scheduler(num_pages=256, max_num_seqs=fit + 8, max_num_batched_tokens=1024)
    running = [
        make_request(f"b{i}", [10 + i] * 20, 6, logit_bias=_full_bias(i)) for i in range(fit - 1)
    ]
    # the room left: MAX_LOGIT_BIAS - 200 = 56 entries
    running.append(make_request("most", [60] * 20, 6, logit_bias={t: 1.0 for t in range(200)}))
    big = make_request("big", [70] * 20, 4, logit_bias={t: 1.0 for t in range(100)})
    small = make_request("small", [80] * 20, 4, logit_bias={5: 1.0})  # 1 entry: would fit
    plain = make_request("plain", [90] * 20, 4)
    for r in [*running, big, small, plain]:
        s.add_request(r)
    out = s.schedule()
    assert {r.request_id for r in out.row_requests} == {r.request_id for r in running} | {"plain"}
    assert [r.request_id for r in s.waiting] == ["big", "small"]
    s.check_invariants()
    fake_step(s, out)
    while s.has_unfinished():
        out = s.schedule()
        s.check_invariants()
        if out is None:
            break
        fake_step(s, out)
    for r in [*running, big, small, plain]:
        assert r.output_token_ids == expected_output(r.prompt_token_ids, r.params.max_tokens)
