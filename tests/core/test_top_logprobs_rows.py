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

from nori_jax.core.output_processor import OutputProcessor
from nori_jax.core.outputs import EngineCoreOutputs
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
    block = update.top_logprobs  # the listed rows' arrays, as wide as the widest request asked
    assert block.request_ids == ["three", "twenty"] and block.width == TOP_LOGPROBS
    assert block.pairs() == {
        "three": tuple((j, -float(j)) for j in range(TOP_LOGPROBS)),
        "twenty": tuple((1000 + j, -float(j)) for j in range(TOP_LOGPROBS)),
    }
    s.check_invariants()

    # The output processor hands each request its own k of them.
    processor = OutputProcessor(None)
    for r in reqs:
        processor.add(r.request_id, None, r.prompt_token_ids, r.params, stream=True)
    outputs, _ = processor.process(
        EngineCoreOutputs(
            update.request_ids,
            update.token_ids.tobytes(),
            update.logprobs.tobytes(),
            [],
            [],
            top_logprobs=update.top_logprobs,
        )
    )
    by_id = {o.request_id: o for o in outputs}
    assert by_id["three"].new_top_logprobs == [((0, 0.0), (1, -1.0), (2, -2.0))]
    assert by_id["twenty"].new_top_logprobs == [tuple((1000 + j, -float(j)) for j in range(20))]
    assert by_id["zero"].new_top_logprobs is None and by_id["none"].new_top_logprobs is None


def test_the_block_is_cut_to_the_widest_count_asked():
    s = make_scheduler(num_pages=64, max_num_seqs=4, max_num_batched_tokens=64)
    s.add_request(make_request("two", [5] * 8, 2, logprobs=2))
    s.add_request(make_request("four", [6] * 8, 2, logprobs=4))
    out = s.schedule()
    tokens = FakeDevice(s).execute(build(s, out))
    ids = np.arange(2 * TOP_LOGPROBS).reshape(2, TOP_LOGPROBS)
    values = -np.ones((2, TOP_LOGPROBS), np.float32)
    block = s.update(out, tokens, np.zeros(len(tokens), np.float32), (ids, values)).top_logprobs
    assert block.width == 4 and block.ids.tolist() == ids[:, :4].tolist()


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
    assert s.allocator.num_used_pages == 0 and not s.slots.top_logprobs.any()


def test_rows_whose_request_left_its_slot_go_to_the_preempted_not_the_finished():
    """A request preempted after its step was planned still gets that step's token, so its top
    logprobs too; one finished meanwhile (abort, stop string) gets neither."""
    s = make_scheduler(num_pages=64, max_num_seqs=4, max_num_batched_tokens=64)
    reqs = [make_request(n, [5 + i] * 8, 4, logprobs=2 + i) for i, n in enumerate("abc")]
    for r in reqs:
        s.add_request(r)
    out = s.schedule()
    tokens = FakeDevice(s).execute(build(s, out))
    s.finish_request("a", "abort")
    s._preempt(reqs[1])  # "b" leaves its slot for the waiting queue
    ids = np.arange(3 * TOP_LOGPROBS).reshape(3, TOP_LOGPROBS)
    values = np.zeros((3, TOP_LOGPROBS), np.float32)
    block = s.update(out, tokens, np.zeros(len(tokens), np.float32), (ids, values)).top_logprobs
    names = [r.request_id for r in out.row_requests]
    rows = {names[i]: p for p, i in enumerate(out.top_rows)}
    assert block.request_ids == ["b", "c"] and block.width == 4  # c asked 4, b 3, a is gone
    assert block.ids.tolist() == [ids[rows["b"], :4].tolist(), ids[rows["c"], :4].tolist()]
    assert reqs[1].output_token_ids == [tokens[names.index("b")]]
    s.check_invariants()
