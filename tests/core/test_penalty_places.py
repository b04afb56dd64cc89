"""Penalties and min_tokens on the host side: the device keeps each slot's token counts and
rebuilds them from what each step lists (clear a new request's slot, mark prompt positions,
recount recomputed outputs, count samples). A device that does exactly that, in numpy, checks
before every sample that the slot's counts are the request's true history, through chunked
prefill, preemption, overlapped steps and the prefix cache."""

from __future__ import annotations

import collections

import numpy as np
from fake_runner import (
    VOCAB,
    FakeDevice,
    build,
    expected_output,
    finish_counting,
    make_request,
    make_scheduler,
    run_to_completion,
    shared_prefix_requests,
)

from nori_jax.core.request import Request
from nori_jax.core.step_layout import PENALTY_FRESH, PENALTY_SAMPLES
from nori_jax.sampling_params import SamplingParams


class PenaltyDevice(FakeDevice):
    """A FakeDevice that also keeps the slots' penalty counts as the jitted step does
    (executor/penalties.py) and asserts, for every listed row that samples, that its slot's
    counts hold the request's outputs so far (and, with a repetition penalty, its prompt's
    tokens)."""

    def __init__(self, s):
        super().__init__(s)
        n = s.config.max_num_seqs
        self.counts = np.zeros((n, VOCAB), np.int64)
        self.in_prompt = np.zeros((n, VOCAB), bool)
        self.checked = 0

    def execute(self, plan):
        view = lambda name: plan.layout.view(plan.buffer, name)  # noqa: E731
        rows, slots, flags = view("penalty_rows"), view("penalty_slots"), view("penalty_flags")
        prompt_len, count_from = view("penalty_prompt_len"), view("penalty_count_from")
        ids = np.where(
            plan.prev_index >= 0, self.prev_tokens[np.maximum(plan.prev_index, 0)], plan.input_ids
        )
        n = int((rows < self.s.config.max_num_seqs).sum())
        assert (rows[n:] == self.s.config.max_num_seqs).all(), "listed rows come first"
        expected = [i for i, r in enumerate(plan.scheduled.row_requests) if r.params.has_penalties]
        assert rows[:n].tolist() == expected
        assert slots[:n].tolist() == plan.scheduled.row_slots[expected].tolist()
        for j in range(n):
            if flags[j] & PENALTY_FRESH:
                self.counts[slots[j]], self.in_prompt[slots[j]] = 0, False
        marked = view("penalty_mark_entries")
        for entry, tok in zip(marked.tolist(), view("penalty_mark_tokens").tolist(), strict=True):
            if entry < n:  # a new request's cached prompt token
                assert flags[entry] & PENALTY_FRESH
                self.in_prompt[slots[entry], tok] = True
        for j in range(n):
            r, slot = int(rows[j]), int(slots[j])
            req = plan.scheduled.row_requests[r]
            lo, hi = plan.cu_q_lens[r], plan.cu_q_lens[r + 1]
            for k in range(lo, hi):
                pos, tok = int(plan.positions[k]), int(ids[k])
                if pos < prompt_len[j]:
                    self.in_prompt[slot, tok] = True
                elif pos < count_from[j]:
                    self.counts[slot, tok] += 1
            if flags[j] & PENALTY_SAMPLES:
                seq = self._before(req, int(plan.kv_lens[r]) - int(hi - lo)) + ids[lo:hi].tolist()
                truth = np.bincount(seq[req.num_prompt_tokens :], minlength=VOCAB)
                np.testing.assert_array_equal(self.counts[slot], truth, err_msg=req.request_id)
                if req.params.repetition_penalty != 1.0:
                    in_prompt = np.zeros(VOCAB, bool)
                    in_prompt[req.prompt_token_ids] = True
                    np.testing.assert_array_equal(self.in_prompt[slot], in_prompt)
                self.checked += 1
        tokens = super().execute(plan)
        for j in range(n):
            if flags[j] & PENALTY_SAMPLES:
                self.counts[slots[j], tokens[rows[j]]] += 1
        return tokens


def _penalized(rid: str, prompt: list[int], max_tokens: int, **penalties) -> Request:
    return Request(
        rid,
        list(prompt),
        SamplingParams(max_tokens=max_tokens, temperature=0.0, **penalties),
        seed=0,
    )


def _mixed(reqs: list[Request]) -> list[Request]:
    """Every other request with a penalty (all three kinds in turn), the rest without."""
    kinds = [
        dict(repetition_penalty=1.3),
        dict(presence_penalty=0.5),
        dict(frequency_penalty=-0.2, repetition_penalty=0.9),
    ]
    return [
        _penalized(r.request_id, r.prompt_token_ids, r.params.max_tokens, **kinds[i // 2 % 3])
        if i % 2 == 0
        else r
        for i, r in enumerate(reqs)
    ]


def test_counts_are_each_requests_history_through_preemption_and_overlap():
    for overlap in (False, True):
        reqs = _mixed(shared_prefix_requests(24, seed=8, max_own=50, max_tokens=(1, 40)))
        s = make_scheduler(num_pages=20, max_model_len=128, kv_headroom=0.0)
        device = PenaltyDevice(s)
        done = run_to_completion(s, reqs, overlap=overlap, device=device)
        assert s.counters.num_preemptions > 0 and s.counters.prefix_cache_hits > 0
        assert device.checked > 100
        for r in reqs:  # (the fake model ignores penalties: outputs stay its own)
            assert done[r.request_id].output_token_ids == expected_output(
                r.prompt_token_ids, r.params.max_tokens
            )


def test_cached_prompt_tokens_come_as_marks_within_the_steps_room(monkeypatch):
    """A new request with repetition_penalty reads the prefix cache: its cached prompt tokens
    pass through no step, so their distinct ids come as marks in its first step (the device
    above checks its prompt table holds the whole prompt before it samples). Past the step's mark
    room it computes its whole prompt instead."""
    system = list(range(300, 340))  # two full pages of 16: 32 distinct ids cached
    s = make_scheduler(num_pages=64)
    device = PenaltyDevice(s)
    run_to_completion(s, [make_request("warm", system + [5], 2)], device=device)
    hits = s.counters.prefix_cache_hits
    run_to_completion(
        s, [_penalized("rep", system + [6], 2, repetition_penalty=1.2)], device=device
    )
    assert s.counters.prefix_cache_hits == hits + 32 and device.checked == 2
    monkeypatch.setattr("nori_jax.core.scheduler.PENALTY_MARKS", 31)  # one id short
    run_to_completion(
        s, [_penalized("rep2", system + [7], 2, repetition_penalty=1.2)], device=device
    )
    assert s.counters.prefix_cache_hits == hits + 32 and device.checked == 4
    run_to_completion(s, [_penalized("presence", system + [8], 2, presence_penalty=1.0)])
    assert s.counters.prefix_cache_hits == hits + 64  # outputs only: no marks needed


def test_every_running_request_may_have_penalties():
    """No room to wait for: counts are per slot, so a full batch of penalized requests runs."""
    s = make_scheduler(num_pages=512, max_num_seqs=72, max_num_batched_tokens=2048)
    reqs = [_penalized(f"q{i}", [10 + i] * 12, 4, presence_penalty=0.1) for i in range(72)]
    for r in reqs:
        s.add_request(r)
    out = s.schedule()
    assert len(out.row_requests) == 72 and not s.waiting
    most = finish_counting(s, out, lambda running: sum(r.params.has_penalties for r in running))
    assert most == 72
    for r in reqs:
        assert r.output_token_ids == expected_output(r.prompt_token_ids, 4), r.request_id


def test_min_tokens_bans_the_stop_ids_below_the_minimum_only():
    """-inf on the request's stop ids and EOS in the step's logit_bias entries while the row
    samples an output index below min_tokens; none after, none for ignore_eos's EOS."""
    s = make_scheduler(num_pages=64, max_num_batched_tokens=64)
    req = Request(
        "m",
        [5] * 20,
        SamplingParams(max_tokens=6, temperature=0.0, min_tokens=3, stop_token_ids=[9, 7]),
        seed=0,
        eos_token_ids=(2,),
    )
    other = Request(
        "o",
        [6] * 4,
        SamplingParams(max_tokens=6, temperature=0.0, min_tokens=6, ignore_eos=True),
        seed=0,
        eos_token_ids=(2,),
    )
    s.add_request(req)
    s.add_request(other)
    banned = collections.defaultdict(list)  # request id -> per sampling row: its banned ids
    while s.has_unfinished():
        out = s.schedule()
        plan = build(s, out)
        view = lambda name, plan=plan: plan.layout.view(plan.buffer, name)  # noqa: E731
        n = int((view("bias_values") != 0).sum())
        for i, r in enumerate(out.row_requests):
            mine = view("bias_rows")[:n] == i
            assert (view("bias_values")[:n][mine] == -np.inf).all()
            if out.row_samples[i]:
                banned[r.request_id].append(sorted(view("bias_tokens")[:n][mine].tolist()))
        s.update(out, _device(s).execute(plan))
    assert banned["m"] == [[2, 7, 9]] * 3 + [[]] * 3
    assert banned["o"] == [[]] * 6  # ignore_eos and no stop ids: nothing to ban


def _device(s):
    if not hasattr(s, "_fake"):
        s._fake = FakeDevice(s)
    return s._fake


def test_no_multi_step_launch_while_a_row_has_penalties_or_is_below_min_tokens():
    for special in (
        _penalized("special", [6] * 10, 6, frequency_penalty=0.3),
        make_request("special", [7] * 10, 12, min_tokens=5),
    ):
        s = make_scheduler(num_pages=64, num_scheduler_steps=4, multi_step_max_seqs=8)
        launches = []  # (steps, the special row's output index or None) per multi-step launch

        def on_step(s, plan, launches=launches):
            names = [r.request_id for r in plan.scheduled.row_requests]
            if plan.num_steps > 1:
                index = plan.layout.view(plan.buffer, "sample_index")
                launches.append(index[names.index("special")] if "special" in names else None)

        reqs = [make_request("plain", [5] * 10, 16), special]
        run_to_completion(s, reqs, on_step=on_step)
        assert launches, "multi-step once the special row is past its condition or done"
        if special.params.has_penalties:
            assert launches == [None] * len(launches)
        else:  # from the launch whose first step samples output 5 on
            assert min(i for i in launches if i is not None) == 5
