"""Prefill/decode disaggregation without a model: each engine core runs a fake device whose KV pool
holds token ids, and whose next token is a function of what it reads back through the page
table. A request decodes right on the decode side only if its prompt's KV was moved into the
pages its page table names there; invariants of every core are checked after every step."""

from __future__ import annotations

import time

import numpy as np
import pytest
from fake_runner import VOCAB, expected_output, make_request, next_token

from nori_jax.core.disaggregated_core import DisaggregatedCore
from nori_jax.core.engine_core import EngineCore, EngineCoreRequest
from nori_jax.core.paging import PageAllocator
from nori_jax.core.plan_builder import PlanBuilder
from nori_jax.core.scheduler import Scheduler
from nori_jax.core.scheduler_config import SchedulerConfig
from nori_jax.sampling_params import SamplingParams

PAGE = 16


class KVDevice:
    """Executes plans: writes each token's id at its slot, samples from the ids read back."""

    def __init__(self, num_pages: int, max_num_seqs: int):
        self.kv = np.full(num_pages * PAGE, -1, np.int64)
        self.prev = np.zeros(max_num_seqs, np.int32)

    num_recompiles = 0

    def launch(self, plan):
        ids = np.where(
            plan.prev_index >= 0, self.prev[np.maximum(plan.prev_index, 0)], plan.input_ids
        )
        n = plan.num_tokens
        self.kv[plan.slot_mapping[:n]] = ids[:n]
        out = np.zeros_like(self.prev)
        for i, samples in enumerate(plan.samples):
            if samples:
                pos = np.arange(plan.kv_lens[i])
                seq = self.kv[plan.page_table[i, pos // PAGE] * PAGE + pos % PAGE]
                assert (seq >= 0).all(), "read KV that was never written"
                out[i] = next_token(seq.tolist())
        self.prev = out
        return out

    def fetch(self, tokens):
        return tokens, np.zeros(len(tokens), np.float32)


class FakeMover:
    """Copies pages between the fake pools; `fail` makes the next moves raise."""

    bytes_per_page = 100
    num_recompiles = 0

    def __init__(self, prefill: list[KVDevice], decode: list[KVDevice]):
        self.prefill, self.decode = prefill, decode
        self.fail = 0
        self.moves: list[tuple[int, int, list[int], list[int]]] = []

    def move(self, src, dst, src_pages, dst_pages):
        if self.fail:
            self.fail -= 1
            raise OSError("injected transfer failure")
        assert len(src_pages) == len(dst_pages) and min(dst_pages) > 0
        s, d = self.prefill[src].kv, self.decode[dst].kv
        for a, b in zip(src_pages, dst_pages, strict=True):
            d[b * PAGE : (b + 1) * PAGE] = s[a * PAGE : (a + 1) * PAGE]
        self.moves.append((src, dst, list(src_pages), list(dst_pages)))
        return object()

    def is_done(self, handle):
        return True

    def wait(self, handle):
        pass


def make_core(
    prefill: int = 1,
    decode: int = 1,
    overlap: bool = True,
    decode_pages: int = 64,
    max_model_len: int = 256,
    prefill_pages: int = 64,
    **scheduler,
):
    cfg = SchedulerConfig(
        **(
            dict(max_model_len=max_model_len, page_size=PAGE, max_num_seqs=8)
            | dict(max_num_batched_tokens=64)
            | scheduler
        )
    )

    def core(num_pages: int, hand_off: bool) -> EngineCore:
        s = Scheduler(cfg, PageAllocator(num_pages, PAGE), hand_off=hand_off)
        b = PlanBuilder(cfg.max_num_seqs, cfg.max_pages_per_seq, PAGE, num_pages, s.buckets, VOCAB)
        return EngineCore(s, b, KVDevice(num_pages, cfg.max_num_seqs), async_scheduling=overlap)

    pre = [core(prefill_pages, True) for _ in range(prefill)]
    dec = [core(decode_pages, False) for _ in range(decode)]
    mover = FakeMover([c.executor for c in pre], [c.executor for c in dec])
    return DisaggregatedCore(pre, dec, mover)


def request(rid: str, prompt: list[int], max_tokens: int = 8, **params) -> EngineCoreRequest:
    p = SamplingParams(max_tokens=max_tokens, temperature=0.0, **params)
    return EngineCoreRequest(rid, prompt, p, 0, [], time.monotonic())


def run(core: DisaggregatedCore, reqs: list[EngineCoreRequest], on_step=None):
    for r in reqs:
        core.add_request(r)
    tokens: dict[str, list[int]] = {}
    finished, transfers = {}, []
    for _ in range(2000):
        if not (core.has_unfinished() or core.has_in_flight):
            break
        out = core.step() if core.has_unfinished() else core.drain()
        core.check_invariants()
        for rid, tok in zip(out.request_ids, out.token_ids.tolist(), strict=True):
            tokens.setdefault(rid, []).append(tok)
        finished |= {f.request_id: f for f in out.finished}
        transfers += out.transfers
        if on_step:
            on_step(core)
    assert not core.has_unfinished(), "made no progress"
    for c in core.cores:
        assert c.scheduler.allocator.num_used_pages == 0, "pages leaked"
    return tokens, finished, transfers


def random_requests(n: int, seed: int) -> list[EngineCoreRequest]:
    rng = np.random.default_rng(seed)
    return [
        request(
            f"r{i}", rng.integers(3, 900, rng.integers(2, 90)).tolist(), int(rng.integers(2, 16))
        )
        for i in range(n)
    ]


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("shape", [(1, 1), (2, 2)])
def test_every_request_decodes_on_moved_kv_with_exact_tokens(shape, overlap):
    core = make_core(*shape, overlap=overlap)
    reqs = random_requests(24, seed=1)
    tokens, finished, transfers = run(core, reqs)
    for r in reqs:
        assert tokens[r.request_id] == expected_output(r.prompt_token_ids, r.params.max_tokens)
        assert finished[r.request_id].finish_reason == "length"
    assert sorted(t.request_id for t in transfers) == sorted(r.request_id for r in reqs)
    assert all(t.error is None and t.num_bytes == 100 * t.num_pages for t in transfers)
    used = {(src, dst) for src, dst, _, _ in core.mover.moves}
    assert {s for s, _ in used} == set(range(shape[0])) and {d for _, d in used} == set(
        range(shape[1])
    )


def test_first_token_that_ends_the_request_needs_no_transfer():
    core = make_core()
    first = next_token([5, 6, 7])
    reqs = [
        request("one", [5, 6, 7], max_tokens=1),
        request("eos", [5, 6, 7], 8, stop_token_ids=[first]),
    ]
    tokens, finished, transfers = run(core, reqs)
    assert tokens == {"one": [first], "eos": [first]}
    assert finished["one"].finish_reason == "length" and finished["eos"].finish_reason == "stop"
    assert transfers == [] and core.mover.moves == []


def test_a_failed_transfer_is_retried_and_loses_nothing():
    core = make_core()
    core.mover.fail = 2  # two failures, then the third attempt goes through
    reqs = random_requests(4, seed=2)
    tokens, finished, transfers = run(core, reqs)
    for r in reqs:
        assert tokens[r.request_id] == expected_output(r.prompt_token_ids, r.params.max_tokens)
    failed = [t for t in transfers if t.error is not None]
    assert len(failed) == 2 and "injected" in failed[0].error
    assert core.num_transfer_failures == 2 and core.num_recomputed == 0
    assert len([t for t in transfers if t.error is None]) == 4


def test_repeated_transfer_failures_fall_back_to_recompute_on_the_decode_side():
    core = make_core()
    core.mover.fail = 10**6  # every move fails
    reqs = random_requests(3, seed=3)
    tokens, finished, transfers = run(core, reqs)
    for r in reqs:
        assert tokens[r.request_id] == expected_output(r.prompt_token_ids, r.params.max_tokens)
    assert core.num_recomputed == 3 and core.num_transfers == 0
    assert len(transfers) == 3 * core.max_transfer_attempts


def test_a_full_decode_pool_holds_kv_back_and_preempts_on_the_decode_side():
    # 14 usable decode pages for 12 requests of up to 6 pages each: moves wait for room, and the
    # decode side preempts (recomputing there) when its decodes outgrow the pool.
    core = make_core(decode_pages=15, max_model_len=96)
    reqs = [request(f"r{i}", list(range(10 + i, 50 + i)), max_tokens=40) for i in range(12)]
    waited = []
    tokens, _, _ = run(
        core, reqs, on_step=lambda c: waited.append(len(c.prefill[0].scheduler.handed_off))
    )
    for r in reqs:
        assert tokens[r.request_id] == expected_output(r.prompt_token_ids, r.params.max_tokens)
    assert max(waited) > 0, "no request ever waited for room on the decode side"
    assert core.decode[0].scheduler.counters.num_preemptions > 0


def test_a_prefill_engine_never_preempts_a_request_whose_prompt_is_computed():
    # Long prompts prefill 16 tokens a step; a short one, admitted later, computes its prompt in
    # one step. When the long one next needs a page of the full pool, the newer short request is
    # the only candidate, but its KV is about to move: the long one waits instead.
    cfg = SchedulerConfig(
        max_model_len=64,
        page_size=PAGE,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        long_prefill_threshold=40,
        kv_headroom=0.0,
    )
    s = Scheduler(cfg, PageAllocator(5, PAGE), hand_off=True)
    s.add_request(make_request("long", list(range(3, 53))))
    first = s.schedule()  # long: 16 tokens, one page
    s.add_request(make_request("short", list(range(200, 220))))
    second = s.schedule()  # long: 16 more; short: its whole prompt, its sample in flight
    s.update(first, np.zeros(4, np.int32))
    assert s.allocator.num_free_pages == 0
    third = s.schedule()  # long needs a third page
    assert s.counters.num_preemptions == 0 and third is None
    s.update(second, np.full(4, 7, np.int32))
    assert [r.request_id for r in s.handed_off] == ["short"]
    s.check_invariants()


def test_decode_side_prefix_cache_skips_moving_pages_it_holds():
    core = make_core()
    shared = list(range(100, 148))  # three full pages
    a, b = shared + [1, 2, 3], shared + [4, 5]
    tokens, _, transfers = run(core, [request("a", a)])
    tokens_b, _, transfers_b = run(core, [request("b", b)])
    assert tokens["a"] == expected_output(a, 8) and tokens_b["b"] == expected_output(b, 8)
    assert {t.request_id: t.num_pages for t in transfers + transfers_b} == {"a": 4, "b": 1}
    ((_, _, _, b_dst),) = core.mover.moves[1:]
    assert len(b_dst) == 1  # only the last, partial page of b; the three shared ones were cached


def test_abort_while_waiting_for_the_decode_side_frees_the_prefill_pages():
    core = make_core(decode_pages=7, max_model_len=96)  # room for one request at a time
    core.add_request(request("a", list(range(10, 70)), max_tokens=30))
    core.add_request(request("b", list(range(20, 80)), max_tokens=30))
    for _ in range(50):
        core.step()
        if core.prefill[0].scheduler.handed_off:
            break
    rid = core.prefill[0].scheduler.handed_off[0].request_id
    assert core.abort(rid).finish_reason == "abort"
    core.check_invariants()
    tokens, _, _ = run(core, [])
    other = "b" if rid == "a" else "a"
    assert other in tokens


def test_duplicate_ids_are_refused_across_cores():
    core = make_core(2, 2)
    core.add_request(request("x", [1, 2, 3]))
    with pytest.raises(ValueError, match="already in use"):
        core.add_request(request("x", [4, 5, 6]))


def test_a_request_with_penalties_is_recomputed_on_the_decode_side():
    """Its decode side builds the penalty counts from the tokens its own steps see, so it
    computes the prompt there again rather than taking moved KV; the others still move."""
    core = make_core()
    reqs = random_requests(4, seed=4)
    reqs[1] = request("pen", [5, 6, 7, 8], 6, presence_penalty=0.5)
    tokens, finished, transfers = run(core, reqs)
    for r in reqs:  # (the fake device ignores penalties: outputs stay its own)
        assert tokens[r.request_id] == expected_output(r.prompt_token_ids, r.params.max_tokens)
    assert core.num_recomputed == 1
    assert sorted(t.request_id for t in transfers) == sorted(
        r.request_id for r in reqs if r.request_id != "pen"
    )


def test_prompt_logprobs_are_planned_on_the_prefill_side_only():
    """A request asking for its prompt's logprobs, recomputed on the decode side (its moves
    fail): the prefill side plans every position; the decode side, recomputing the prompt,
    plans none again (they came from the prefill side)."""
    core = make_core()
    core.mover.fail = 10**6
    planned = {"prefill": 0, "decode": 0}
    for side, cores in (("prefill", core.prefill), ("decode", core.decode)):
        sched = cores[0].scheduler
        real = sched.schedule

        def counting(real=real, side=side):
            out = real()
            if out is not None:
                planned[side] += sum(e.count for e in out.prompt_logprobs)
            return out

        sched.schedule = counting
    req = request("p", list(range(3, 43)), 4, prompt_logprobs=0)
    tokens, _, _ = run(core, [req])
    assert tokens["p"] == expected_output(req.prompt_token_ids, 4)
    assert core.num_recomputed == 1
    assert planned == {"prefill": 39, "decode": 0}
