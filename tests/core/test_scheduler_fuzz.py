"""Randomized stateful test of the scheduler: seeded random interleavings of arrivals, aborts,
finishes from outside (a stop string) and steps, driven as EngineCore drives them (synchronous,
or overlapped: the next step planned before the previous one's samples are delivered), with the
fake device of fake_runner.py. Invariants are checked after every schedule and update; at the
end every request finished exactly once, with the tokens a run of it alone gives, and nothing
(pages, slots) is held.

Each case is deterministic (its seed). A failure names the case; shrink it to a short explicit
sequence of calls and keep that as a test of its own.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
from fake_runner import (
    FakeDevice,
    build,
    check_plan,
    expected_output,
    fake_step,
    make_request,
    make_scheduler,
)

from nori_jax.core.request import Request, RequestStatus

PAGE = 16
MAX_MODEL_LEN = 256  # 16 pages a sequence


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    config: dict  # make_scheduler's arguments (num_pages and SchedulerConfig fields)
    overlap: bool  # plan step N+1 before step N's update (EngineCore's async scheduling)
    seed: int
    # "shared": every request has the same EOS ids (one tokenizer); "mixed": requests carry
    # EOS ids of their own (EngineCoreRequest.eos_token_ids is per request)
    eos: str = "shared"
    ops: int = 300
    arrivals: float = 0.3  # chance that an operation of a busy stretch adds requests
    # what the case must have exercised (so a change to the driver cannot make it vacuous)
    expect: tuple[str, ...] = ()


_BASE = dict(max_model_len=MAX_MODEL_LEN, page_size=PAGE)
CONFIGS = {
    # 19 usable pages for 8 sequences of up to 16 pages: preemption all the time
    "preempt": dict(
        _BASE, num_pages=20, max_num_seqs=8, max_num_batched_tokens=64, kv_headroom=0.0
    ),
    # a budget of one page a step: every prompt is chunked, decodes share the budget
    "chunked": dict(_BASE, num_pages=40, max_num_seqs=8, max_num_batched_tokens=16),
    # long prompts in their own queue and token share
    "long": dict(
        _BASE,
        num_pages=32,
        max_num_seqs=6,
        max_num_batched_tokens=48,
        long_prefill_threshold=64,
        long_prefill_token_share=0.25,
        max_num_long_prefills=1,
    ),
    "multistep": dict(
        _BASE, num_pages=20, max_num_seqs=6, max_num_batched_tokens=64, num_scheduler_steps=4
    ),
    "priority": dict(
        _BASE,
        num_pages=20,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        kv_headroom=0.0,
        scheduling_policy="priority",
    ),
    "priority_multistep": dict(
        _BASE,
        num_pages=22,
        max_num_seqs=6,
        max_num_batched_tokens=48,
        scheduling_policy="priority",
        num_scheduler_steps=4,
        long_prefill_threshold=96,
    ),
    # multi-step with a one-page budget: prefills end one token short of the prompt, and the
    # multi-step launch computes that token and samples the first
    "multistep_chunked": dict(
        _BASE,
        num_pages=18,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        kv_headroom=0.0,
        num_scheduler_steps=4,
    ),
    "no_prefix_cache": dict(
        _BASE,
        num_pages=20,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        kv_headroom=0.0,
        enable_prefix_caching=False,
    ),
    "no_wait_shared": dict(
        _BASE, num_pages=28, max_num_seqs=8, max_num_batched_tokens=40, wait_for_shared_prefix=False
    ),
}
EXPECT = {
    "preempt": ("preemption", "recomputed", "prefix_hit", "stop_token", "eos", "length_by_context"),
    "chunked": ("prefix_hit", "chunked"),
    "long": ("prefix_hit", "long"),
    "multistep": ("multi_step", "multi_step_stop", "preemption", "prefix_hit"),
    "priority": ("preemption", "recomputed", "prefix_hit"),
    "priority_multistep": ("multi_step", "multi_step_stop", "preemption", "long"),
    "multistep_chunked": (
        "multi_step",
        "multi_step_stop",
        "first_token_in_multi_step",
        "preemption",
        "recomputed",
    ),
    "no_prefix_cache": ("preemption", "recomputed"),
    "no_wait_shared": ("prefix_hit",),
}

# multi-step launches need a batch that only decodes and an empty queue: a lighter load, longer
ARRIVALS = {"multistep": 0.2, "priority_multistep": 0.2, "multistep_chunked": 0.12}
OPS = {"multistep": 450, "priority_multistep": 450, "multistep_chunked": 450}
SEEDS = {"multistep_chunked": 21}

CASES = [
    Case(
        f"{name}-{'overlap' if overlap else 'sync'}",
        cfg,
        overlap,
        SEEDS.get(name, seed),
        ops=OPS.get(name, 300),
        arrivals=ARRIVALS.get(name, 0.3),
        expect=EXPECT[name],
    )
    for seed, (name, cfg) in enumerate(CONFIGS.items())  # a seed per configuration
    for overlap in (False, True)
]


class KVDevice(FakeDevice):
    """A FakeDevice that also keeps the KV pool: each KV position holds the token id written
    there (through `slot_mapping` and, in a multi-step launch, the row's page table), and each
    row that attends checks, through its page table, that positions [0, kv_len) hold exactly its
    sequence's tokens. Catches a page read from the prefix cache or the page table that does not
    hold what the request needs (a wrong hash, a page reused while held, a shared page written),
    which the tokens alone cannot show: the fake model reads the host's tokens, not the KV."""

    def __init__(self, s):
        super().__init__(s)
        self.kv = np.full(s.allocator.num_pages * s.page_size, -1, np.int64)

    def _slots(self, page_row: np.ndarray, positions: np.ndarray) -> np.ndarray:
        ps = self.s.page_size
        return page_row[positions // ps].astype(np.int64) * ps + positions % ps

    def _read(self, req, page_row: np.ndarray, want: list[int]) -> None:
        got = self.kv[self._slots(page_row, np.arange(len(want)))]
        assert got.tolist() == want, f"{req.request_id}: its KV pages hold other tokens"

    def execute(self, plan):
        rows = plan.scheduled.row_requests
        ids = np.where(
            plan.prev_index >= 0, self.prev_tokens[np.maximum(plan.prev_index, 0)], plan.input_ids
        )
        if plan.num_steps > 1:
            before = [self._before(req, int(plan.positions[i])) for i, req in enumerate(rows)]
            tokens = super().execute(plan)
            for i, req in enumerate(rows):
                k, start = int(plan.decode_steps[i]), int(plan.positions[i])
                fed = [int(ids[i])] + tokens[: k - 1, i].tolist()  # each step's input
                page_row = plan.page_table[i]
                self.kv[self._slots(page_row, np.arange(start, start + k))] = fed
                self._read(req, page_row, before[i] + fed)
            return tokens
        n = plan.num_tokens
        self.kv[plan.slot_mapping[:n]] = ids[:n]
        for i, req in enumerate(rows):
            lo, hi = plan.cu_q_lens[i], plan.cu_q_lens[i + 1]
            start = int(plan.kv_lens[i]) - (hi - lo)
            self._read(req, plan.page_table[i], self._before(req, start) + ids[lo:hi].tolist())
        return super().execute(plan)


class Driver:
    """One case: the scheduler, the fake device, and what each request must end with."""

    def __init__(self, case: Case):
        self.case = case
        self.rng = random.Random(case.seed)
        self.s = make_scheduler(**case.config)
        self.cfg = self.s.config
        self.device = KVDevice(self.s)
        self.s._fake = self.device
        self.in_flight = None  # (SchedulerOutput, samples) launched, not yet updated
        self.start_free = self.s.allocator.num_free_pages
        self.requests: dict[str, Request] = {}
        self.solo: dict[str, tuple[list[int], str]] = {}  # its tokens and reason run alone
        self.delivered: dict[str, list[int]] = {}  # the tokens the updates published
        self.finished: dict[str, str] = {}  # finish reason, recorded once
        self.outside: dict[str, str] = {}  # finished by finish_request (abort, stop string)
        self.first_tokens: dict[str, int] = {}  # how often each was in update.first_tokens
        # Requests whose first token a multi-step launch delivered (a prefill chunk ended one
        # token short of the prompt; test_multi_step_first_token_is_reported below)
        self.first_in_multi_step: set[str] = set()
        self.prompts: list[list[int]] = []
        r = self.rng
        # System prompts of whole pages, so later requests hit the prefix cache.
        self.prefixes = [[r.randrange(3, 1000) for _ in range(PAGE * k)] for k in (1, 2, 3, 4)]
        # The "tokenizer's" EOS ids: two the fake model samples now and then (it samples a few
        # hundred ids only, so random ones would rarely end a request).
        self.eos = tuple(
            r.choice(expected_output([r.randrange(3, 1000) for _ in range(20)], 40)[20:])
            for _ in range(2)
        )
        self.seen = dict.fromkeys(
            (
                "preemption",
                "prefix_hit",
                "stop_token",
                "eos",
                "length_by_context",
                "multi_step",
                "chunked",
                "long",
                "steps",
                "recomputed",
                "multi_step_stop",
                "in_flight_preempted",
                "multi_step_preempted",
                "first_token_in_multi_step",
            ),
            0,
        )
        self.n = 0

    # ---- operations -----------------------------------------------------------------------

    def add(self) -> None:
        r, rid = self.rng, f"r{self.n}"
        self.n += 1
        kind = r.random()
        if kind < 0.45:  # a shared system prompt and a tail of its own (maybe none)
            prompt = list(r.choice(self.prefixes)) + [
                r.randrange(3, 1000) for _ in range(r.choice([0, r.randrange(1, 70)]))
            ]
        elif kind < 0.6 and self.prompts:  # the same prompt again
            prompt = list(r.choice(self.prompts))
        else:
            prompt = [r.randrange(3, 1000) for _ in range(r.randrange(1, 151))]
        prompt = prompt[:150]
        self.prompts.append(prompt)
        u = r.random()  # mostly short outputs, some long enough to reach the context
        lo, hi = (1, 25) if u < 0.7 else (25, 81) if u < 0.9 else (100, 251)
        max_tokens = r.randrange(lo, hi)
        room = min(max_tokens, MAX_MODEL_LEN - len(prompt))  # the context also ends it
        full = expected_output(prompt, room)
        params = {}
        if r.random() < 0.2:  # a stop token it will sample (unless its length comes first)
            params["stop_token_ids"] = [r.choice(full), r.randrange(3, 1003)]
        if r.random() < 0.15:
            params["ignore_eos"] = True
        if self.case.eos == "shared":
            eos = self.eos
        else:
            eos = r.choice([(), self.eos, (r.choice(full),)])
        req = make_request(rid, prompt, max_tokens, **params)
        req.eos_token_ids = tuple(eos)
        if self.cfg.scheduling_policy == "priority":
            req.priority = r.randrange(-2, 3)
        ends = set(params.get("stop_token_ids", ()))
        if not req.params.ignore_eos:
            ends |= set(eos)
        cut = next((i for i, t in enumerate(full) if t in ends), None)
        if cut is not None:
            self.solo[rid] = (full[: cut + 1], "stop")
            kind = "stop_token" if full[cut] in params.get("stop_token_ids", ()) else "eos"
            self.seen[kind] += 1
        else:
            self.solo[rid] = (full, "length")
            self.seen["length_by_context"] += room < max_tokens
        self.requests[rid] = req
        self.delivered[rid] = []
        self.s.add_request(req)

    def finish_outside(self, reason: str) -> None:
        """finish_request on a live request (abort, or a stop string the output processor
        found), now and then on one already finished (a no-op)."""
        r = self.rng
        if self.finished and r.random() < 0.15:
            rid = r.choice(sorted(self.finished))
            assert self.s.finish_request(rid, reason) is None, "finished twice"
            return
        live = sorted(self.s.requests)
        if not live:
            return
        rid = r.choice(live)
        req = self.s.finish_request(rid, reason)
        assert req is self.requests[rid] and req.is_finished and not req.pages
        self._finished(rid, req.finish_reason)
        self.outside[rid] = reason

    def step(self) -> bool:
        """One EngineCore iteration: schedule, build and launch; then update the step due now
        (this one, or with overlap the previous one). False when nothing ran."""
        s = self.s
        out = s.schedule()
        s.check_invariants()
        launched = None
        if out is not None:
            plan = build(s, out)
            check_plan(s, plan)
            self._observe(plan)
            launched = (out, self.device.execute(plan))
        done = self.in_flight if self.case.overlap else launched
        self.in_flight = launched if self.case.overlap else None
        if done is not None:
            # rows whose request was preempted after the step was planned (overlap)
            moved = sum(r.status is RequestStatus.WAITING for r in done[0].row_requests)
            key = "in_flight_preempted" if done[0].decode_steps is None else "multi_step_preempted"
            self.seen[key] += moved
            upd = s.update(*done)
            s.check_invariants()
            self._deliver(upd, multi_step=done[0].decode_steps is not None)
            if done[0].decode_steps is not None:
                self.seen["multi_step_stop"] += any(r.finish_reason == "stop" for r in upd.finished)
        self._check_live()
        return launched is not None or done is not None

    # ---- bookkeeping ----------------------------------------------------------------------

    def _observe(self, plan) -> None:
        self.seen["steps"] += 1
        self.seen["multi_step"] += plan.num_steps > 1
        for req, n in zip(
            plan.scheduled.row_requests, plan.scheduled.row_num_tokens.tolist(), strict=True
        ):
            self.seen["chunked"] += 1 < n < req.num_prompt_tokens
            self.seen["long"] += req.is_long

    def _finished(self, rid: str, reason: str | None) -> None:
        assert rid not in self.finished, f"{rid} finished twice"
        assert reason in ("stop", "length", "abort"), (rid, reason)
        self.finished[rid] = reason

    def _deliver(self, upd, multi_step: bool) -> None:
        for rid, tok in zip(upd.request_ids, upd.token_ids.tolist(), strict=True):
            assert rid not in self.finished, f"a token delivered to {rid} after its finish"
            if multi_step and not self.delivered[rid]:
                self.first_in_multi_step.add(rid)
            self.delivered[rid].append(tok)
        for req in upd.first_tokens:
            self.first_tokens[req.request_id] = self.first_tokens.get(req.request_id, 0) + 1
        for req in upd.finished:
            assert req.is_finished and not req.pages and req.slot is None
            self._finished(req.request_id, req.finish_reason)

    def _check_live(self) -> None:
        """Every request's tokens so far are a prefix of its solo run's."""
        for rid, req in self.requests.items():
            want = self.solo[rid][0]
            got = req.output_token_ids
            assert got == want[: len(got)], f"{rid}: {got} is not a prefix of {want}"

    # ---- the case -------------------------------------------------------------------------

    def run(self) -> None:
        r = self.rng
        for i in range(self.case.ops):
            # Bursts of arrivals (queues build up, pages run out, preemption), then quiet
            # stretches (queues drain: the batch decodes alone, multi-step launches)
            busy = (i // 40) % 2 == 0
            u = r.random() - (self.case.arrivals if busy else 0.02)
            if u < 0:
                for _ in range(r.choice([1, 1, 1, 2, 4])):
                    self.add()
            elif u < 0.03:
                self.finish_outside("abort")
            elif u < 0.05:
                self.finish_outside("stop")
            else:
                self.step()
        for _ in range(5000):  # drain: everything left runs to its end
            if not self.step():
                break
        self.seen["preemption"] = self.s.counters.num_preemptions
        self.seen["prefix_hit"] = self.s.counters.prefix_cache_hits
        self.seen["first_token_in_multi_step"] = len(self.first_in_multi_step)
        self.check_end()

    def check_end(self) -> None:
        s, a = self.s, self.s.allocator
        assert self.in_flight is None
        assert not s.has_unfinished(), "requests left unfinished"
        assert not s.requests and not s.running and not s.num_waiting
        assert sorted(self.finished) == sorted(self.requests), "a request never finished"
        for rid, req in self.requests.items():
            assert req.is_finished and req.finish_reason == self.finished[rid]
            assert req.pages == [] and req.slot is None
            assert self.delivered[rid] == req.output_token_ids, f"{rid}: published tokens differ"
            # a first token is reported once, when it came (a multi-step launch's too), and timed
            assert self.first_tokens.get(rid, 0) == (1 if req.output_token_ids else 0), rid
            assert (req.times.first_token is not None) == bool(req.output_token_ids), rid
            want, reason = self.solo[rid]
            if rid in self.outside:
                assert req.finish_reason == self.outside[rid]
                assert req.output_token_ids == want[: len(req.output_token_ids)], rid
            else:
                assert (req.output_token_ids, req.finish_reason) == (want, reason), (
                    f"{rid}: got {req.finish_reason} {req.output_token_ids}, "
                    f"alone it gives {reason} {want}"
                )
                self.seen["recomputed"] += req.num_preemptions > 0
        # No page held: every page free again (cached ones with ref count 0 included).
        assert a.num_free_pages == self.start_free == a.num_usable_pages, "pages leaked"
        assert not any(a.ref_counts), "a page still referenced"
        a.check_invariants([])
        # No slot held.
        assert s.slots.num_free == self.cfg.max_num_seqs, "slots leaked"
        assert all(x is None for x in s.slots.requests.tolist())
        s.check_invariants()
        for what in self.case.expect:
            assert self.seen[what] > 0, f"the case never exercised {what}: {self.seen}"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_scheduler_fuzz(case: Case):
    Driver(case).run()


# ---- requests with EOS ids of their own ---------------------------------------------------------


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize(
    "name",
    ["preempt", "multistep", "priority_multistep"],
)
def test_scheduler_fuzz_mixed_eos(name: str, overlap: bool):
    """Requests with EOS ids of their own (none, the shared ones, or one they will sample), as
    EngineCoreRequest.eos_token_ids allows."""
    cfg = CONFIGS[name]
    case = Case(
        f"{name}-mixed", cfg, overlap, 100 + len(name), "mixed", arrivals=ARRIVALS.get(name, 0.3)
    )
    Driver(case).run()


def test_a_multi_step_row_is_not_cut_at_another_requests_eos():
    """Found by the fuzz (fixed): request "other" (EOS id X) has finished; request "a" has no
    EOS ids, and X is its third token. The 4-step launch after a's prefill samples a's tokens
    2..5; `_update_steps` stopped the row at X because X is in the scheduler's union of EOS ids,
    kept 2 of the 4 samples, and `_finish_reason` (a's own EOS ids: none) did not finish it: a
    then had 7 tokens computed of 6 known with none pending, and schedule() returned None while
    it ran (the engine would have waited for it for ever, its pages and slot held)."""
    prompt = [7, 8, 9]
    full = expected_output(prompt, 12)  # the fake's tokens: [750, 1001, 33, 57, 825, ...]
    s = make_scheduler(num_scheduler_steps=4)
    other = make_request("other", [5], 1)
    other.eos_token_ids = (full[2],)
    s.add_request(other)
    fake_step(s, s.schedule())
    assert other.finish_reason == "length" and not s.has_unfinished()

    a = make_request("a", prompt, 12)  # no EOS ids of its own
    s.add_request(a)
    fake_step(s, s.schedule())  # prefill: the first token
    out = s.schedule()
    assert out.decode_steps.tolist() == [4]
    fake_step(s, out)  # a multi-step launch: tokens 2..5
    assert a.output_token_ids == full[:5]  # was [750, 1001, 33]
    s.check_invariants()


def test_a_multi_step_row_overlapped_keeps_its_tokens_past_another_requests_eos():
    """The same cut with overlapped scheduling: the next launch was planned on the uncut row,
    so its samples followed the device's whole sequence and landed after the cut: tokens 4 and
    5 (57, 825) were missing from a's output."""
    prompt = [7, 8, 9]
    full = expected_output(prompt, 12)
    s = make_scheduler(num_scheduler_steps=4)
    device = FakeDevice(s)
    other = make_request("other", [5], 1)
    other.eos_token_ids = (full[2],)
    s.add_request(other)
    out = s.schedule()
    s.update(out, device.execute(build(s, out)))

    a = make_request("a", prompt, 12)
    s.add_request(a)
    out1 = s.schedule()  # prefill
    tokens1 = device.execute(build(s, out1))
    out2 = s.schedule()  # 4 steps, planned before the prefill's token is known
    tokens2 = device.execute(build(s, out2))
    s.update(out1, tokens1)
    out3 = s.schedule()  # 4 more
    tokens3 = device.execute(build(s, out3))
    s.update(out2, tokens2)  # cut after 2 of its 4 samples
    s.update(out3, tokens3)
    got = a.output_token_ids
    assert got == full[: len(got)]  # was [750, 1001, 33, 401, 833, 657, 25]


# ---- a first token sampled by a multi-step launch ----------------------------------------------


def test_multi_step_first_token_is_reported():
    """Found by the fuzz (fixed). A 17-token prompt under a 16-token budget: the first chunk
    ends on the page boundary, one prompt token short, so the request counts as decoding
    (remaining == 1) and the next launch is multi-step. Its first step computes the last prompt
    token and samples the first output token; `_update_steps` (unlike `update`) reported no
    first token and left times.first_token None: no FirstToken output, no TTFT sample in the
    metrics, RequestMetrics' TTFT, prefill and decode times None."""
    s = make_scheduler(num_scheduler_steps=4, max_num_batched_tokens=16)
    prompt = list(range(3, 20))  # 17 tokens: a page and one token
    a = make_request("a", prompt, 8)
    s.add_request(a)
    out = s.schedule()
    assert out.num_tokens == 16 and out.decode_steps is None
    upd = fake_step(s, out)
    assert upd.request_ids == [] and upd.first_tokens == []
    out = s.schedule()
    assert out.decode_steps.tolist() == [4]  # the last prompt token, then 3 decodes
    upd = fake_step(s, out)
    assert a.output_token_ids == expected_output(prompt, 4)  # right tokens
    assert upd.first_tokens == [a]  # was []
    assert a.times.first_token is not None
