"""Continuous batching: which requests run in the next step, with how many tokens each.

Pure Python + numpy (never JAX), tested with a fake runner. Each step:
  1. decodes of running requests, oldest first (one token each);
  2. chunks of running requests still prefilling (chunked prefill), page-aligned, under the budget;
  3. admission of waiting requests, FCFS, short queue first, then the long-prompt queue within its
     token share; no admission in a step that had to preempt.
When pages run out, the newest running request is preempted (pages freed, re-queued at the front
with the tokens it has, recomputed later); the engine never runs out of memory and never drops work.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time

import numpy as np

from nori_jax.core.batch_slots import BatchSlots
from nori_jax.core.paging import ROOT_HASH, PageAllocator, page_hash
from nori_jax.core.request import Request, RequestStatus
from nori_jax.core.scheduler_config import SchedulerConfig
from nori_jax.core.step_plan import StepPlan, pick_bucket, token_buckets


class QueueFullError(RuntimeError):
    """The waiting queue is at `max_num_waiting`; the caller should retry later (HTTP 429)."""


@dataclasses.dataclass
class SchedulerCounters:
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache at admission
    prefix_cache_hits: int = 0  # of those, tokens found


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: PageAllocator):
        if config.max_pages_per_seq > allocator.num_usable_pages:
            raise ValueError(
                f"max_model_len={config.max_model_len} needs {config.max_pages_per_seq} pages per "
                f"sequence but the KV pool has only {allocator.num_usable_pages}"
            )
        self.config = config
        self.allocator = allocator
        self.page_size = config.page_size
        self.buckets = token_buckets(config.max_num_batched_tokens)
        self.waiting: collections.deque[Request] = collections.deque()
        self.waiting_long: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.counters = SchedulerCounters()
        self.slots = BatchSlots(config.max_num_seqs, config.max_pages_per_seq)
        self._preempted_this_step = False

    # ---- queue management -------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.waiting_long)

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting or self.waiting_long)

    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request_id={req.request_id!r} is already in use")
        limit = self.config.max_num_waiting
        if limit is not None and self.num_waiting >= limit:
            raise QueueFullError(f"waiting queue is full ({limit} requests)")
        threshold = self.config.long_prefill_threshold
        req.is_long = threshold is not None and req.num_prompt_tokens >= threshold
        self.requests[req.request_id] = req
        (self.waiting_long if req.is_long else self.waiting).append(req)

    def finish_request(self, request_id: str, reason: str) -> Request | None:
        """Finish a live request now (stop string, abort, timeout); frees its pages at once."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        if req.status is RequestStatus.WAITING:
            (self.waiting_long if req.is_long else self.waiting).remove(req)
        elif req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        self._release(req, reason)
        return req

    def _release(self, req: Request, reason: str) -> None:
        self.slots.release(req)
        self.allocator.free(req.pages)
        req.pages = []
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.times.finished = time.monotonic()
        del self.requests[req.request_id]

    # ---- one step ---------------------------------------------------------------------------

    def schedule(self) -> StepPlan | None:
        """Pick the next step's work; None when there is nothing to run."""
        cfg = self.config
        self._preempted_this_step = False
        budget = cfg.max_num_batched_tokens
        long_budget = cfg.long_prefill_budget
        rows: list[tuple[Request, int]] = []
        scheduled: set[str] = set()

        # 1. Decodes, oldest first: they keep every running stream moving.
        for req in list(self.running):
            if req.status is not RequestStatus.RUNNING or req.num_remaining != 1 or self._done(req):
                continue
            if self._reserve(req, 1, scheduled, may_preempt_self=True):
                rows.append((req, 1))
                scheduled.add(req.request_id)
                budget -= 1

        # 2. Running prefills (chunked), oldest first.
        for req in list(self.running):
            if req.request_id in scheduled or req.status is not RequestStatus.RUNNING:
                continue
            n = self._chunk_size(req, req.num_computed_tokens, budget, long_budget)
            if n and self._reserve(req, n, scheduled, may_preempt_self=False):
                rows.append((req, n))
                scheduled.add(req.request_id)
                budget -= n
                long_budget -= n if req.is_long else 0

        # 3. Admission, FCFS within each queue; never in a step that had to preempt.
        if not self._preempted_this_step:
            budget = self._admit(self.waiting, rows, budget, long_budget)
            if budget > 0:
                self._admit(self.waiting_long, rows, budget, long_budget - self._long_tokens(rows))

        return self._build_plan(rows) if rows else None

    def _done(self, req: Request) -> bool:
        """The pending token will end it (max_tokens or context reached): schedule nothing more."""
        return req.num_pending_tokens > 0 and (
            len(req.output_token_ids) + req.num_pending_tokens >= req.params.max_tokens
            or req.num_scheduled_total >= self.config.max_model_len
        )

    def _long_tokens(self, rows: list[tuple[Request, int]]) -> int:
        return sum(n for r, n in rows if r.is_long)

    def _chunk_size(self, req: Request, num_computed: int, budget: int, long_budget: int) -> int:
        remaining = req.num_scheduled_total - num_computed
        n = min(remaining, budget, long_budget if req.is_long else budget)
        if 0 < n < remaining:
            # End the chunk on a page boundary when the budget allows, so every page but the last
            # of a chunk is written by one step.
            aligned = (num_computed + n) // self.page_size * self.page_size - num_computed
            if aligned > 0:
                n = aligned
        return max(n, 0)

    def _pages_needed(self, req: Request, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.page_size) - len(req.pages)

    def _reserve(self, req: Request, n: int, scheduled: set[str], may_preempt_self: bool) -> bool:
        """Give `req` pages for n more tokens, preempting newer unscheduled requests if needed."""
        need = self._pages_needed(req, req.num_computed_tokens + n)
        while need > 0:
            pages = self.allocator.allocate(need)
            if pages is not None:
                req.pages.extend(pages)
                self.slots.add_pages(req, pages)
                return True
            victim = self._newest_preemptible(req, scheduled)
            if victim is None:
                if may_preempt_self:
                    self._preempt(req)
                return False
            self._preempt(victim)
        return True

    def _newest_preemptible(self, req: Request, scheduled: set[str]) -> Request | None:
        for victim in reversed(self.running):
            if victim is req:
                return None  # only requests newer than `req` are preempted for it
            if victim.request_id not in scheduled:
                return victim
        return None

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.slots.release(req)
        self.allocator.free(req.pages)
        req.pages = []
        req.num_computed_tokens = 0
        req.num_registered_pages = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        req.times.preemptions.append(time.monotonic())
        (self.waiting_long if req.is_long else self.waiting).appendleft(req)
        self.counters.num_preemptions += 1
        self._preempted_this_step = True

    def _admit(self, queue, rows, budget: int, long_budget: int) -> int:
        cfg = self.config
        headroom = int(cfg.kv_headroom * self.allocator.num_usable_pages)
        while queue and budget > 0 and len(self.running) < cfg.max_num_seqs:
            req = queue[0]
            if req.is_long and self._num_long_prefilling() >= cfg.max_num_long_prefills:
                break
            # Reuse cached full pages, but always leave at least one token to compute: the step
            # must produce logits for the last one, and a shared page is never written.
            cached = self.allocator.lookup(
                self._page_hashes(req, (req.num_tokens - 1) // self.page_size)
            )
            num_cached = len(cached) * self.page_size
            n = self._chunk_size(req, num_cached, budget, long_budget)
            need = math.ceil((num_cached + n) / self.page_size) - len(cached)
            fits = n > 0 and (not self.running or self.allocator.num_free_pages - need >= headroom)
            new_pages = self.allocator.allocate(need) if fits else None
            if new_pages is None:
                self.allocator.free(cached)
                break
            queue.popleft()
            req.pages = cached + new_pages
            self.slots.acquire(req)
            req.num_computed_tokens = req.num_cached_tokens = num_cached
            req.num_registered_pages = len(cached)
            req.status = RequestStatus.RUNNING
            if req.times.first_scheduled is None:
                req.times.first_scheduled = time.monotonic()
            self.counters.prefix_cache_queries += req.num_tokens
            self.counters.prefix_cache_hits += num_cached
            self.running.append(req)
            rows.append((req, n))
            budget -= n
            long_budget -= n if req.is_long else 0
        return budget

    def _num_long_prefilling(self) -> int:
        return sum(1 for r in self.running if r.is_long and r.num_remaining > 1)

    def _page_hashes(self, req: Request, num_pages: int) -> list[bytes]:
        if not self.allocator.enable_prefix_caching:
            return []
        ps = self.page_size
        while len(req.page_hashes) < num_pages:
            i = len(req.page_hashes)
            parent = req.page_hashes[-1] if i else ROOT_HASH
            req.page_hashes.append(page_hash(parent, req.token_ids(i * ps, (i + 1) * ps)))
        return req.page_hashes[:num_pages]

    # ---- the plan ---------------------------------------------------------------------------

    def _build_plan(self, rows: list[tuple[Request, int]]) -> StepPlan:
        cfg, ps, slots = self.config, self.page_size, self.slots
        decodes = [req for req, n in rows if n == 1]
        prefills = [(req, n) for req, n in rows if n != 1]
        reqs = decodes + [req for req, _ in prefills]
        counts = [1] * len(decodes) + [n for _, n in prefills]
        num_rows, num_dec = len(reqs), len(decodes)
        num_tokens = sum(counts)
        t, s = pick_bucket(self.buckets, num_tokens), cfg.max_num_seqs

        row_slots = np.full(s, slots.padding_slot, np.int32)
        row_slots[:num_rows] = [r.slot for r in reqs]
        page_table = slots.page_table[row_slots]  # [S, MP]
        start = np.zeros(s, np.int32)
        start[:num_rows] = [r.num_computed_tokens for r in reqs]
        q_lens = np.zeros(s, np.int32)
        q_lens[:num_rows] = counts
        kv_lens = start + q_lens
        cu_q_lens = np.zeros(s + 1, np.int32)
        np.cumsum(q_lens, out=cu_q_lens[1:])
        logits_indices = np.maximum(cu_q_lens[1:] - 1, 0).astype(np.int32)

        input_ids = np.zeros(t, np.int32)
        positions = np.zeros(t, np.int32)
        slot_mapping = np.zeros(t, np.int32)  # padding -> page 0, slot 0
        # Decode rows, vectorized: one token each, at position start.
        # A one-token row is usually a decode: its token is the last one, or, when the previous
        # step's sample has not reached the host yet, a placeholder the device fills from that
        # step's output (prev_index). It can also be a one-token prefill chunk cut by the budget.
        prev_index = np.full(t, -1, np.int32)
        prev_index[:num_dec] = [r.last_row if r.num_pending_tokens else -1 for r in decodes]
        input_ids[:num_dec] = [
            0
            if r.num_pending_tokens
            else r.last_token
            if r.num_computed_tokens == r.num_tokens - 1
            else r.token_ids(r.num_computed_tokens, r.num_computed_tokens + 1)[0]
            for r in decodes
        ]
        pos = start[:num_dec]
        positions[:num_dec] = pos
        slot_mapping[:num_dec] = page_table[np.arange(num_dec), pos // ps] * ps + pos % ps
        # Prefill chunks: few rows, many tokens each.
        offset = num_dec
        for i, (req, n) in enumerate(prefills, start=num_dec):
            pos = np.arange(start[i], start[i] + n, dtype=np.int32)
            input_ids[offset : offset + n] = req.token_ids(int(start[i]), int(start[i]) + n)
            positions[offset : offset + n] = pos
            slot_mapping[offset : offset + n] = page_table[i, pos // ps] * ps + pos % ps
            offset += n
        sample_index = np.zeros(s, np.int32)
        sample_index[:num_rows] = [len(r.output_token_ids) + r.num_pending_tokens for r in reqs]
        samples = [
            int(k) + n == r.num_scheduled_total
            for r, k, n in zip(reqs, start, counts, strict=False)
        ]
        # The plan is final: advance each request as if the step had run (see Request).
        for i, (r, n, smp) in enumerate(zip(reqs, counts, samples, strict=True)):
            r.num_computed_tokens += n
            if smp:
                r.num_pending_tokens += 1
                r.last_row = i
        # JAX clips out-of-range indices silently, which would corrupt another request's KV.
        assert 0 <= page_table.min() and page_table.max() < self.allocator.num_pages, "bad page id"
        return StepPlan(
            input_ids=input_ids,
            positions=positions,
            slot_mapping=slot_mapping,
            cu_q_lens=cu_q_lens,
            kv_lens=kv_lens,
            page_table=page_table,
            distribution=np.asarray([num_dec, num_rows], np.int32),
            logits_indices=logits_indices,
            temperature=slots.temperature[row_slots],
            top_p=slots.top_p[row_slots],
            top_k=slots.top_k[row_slots],
            seeds=slots.seeds[row_slots],
            sample_index=sample_index,
            prev_index=prev_index,
            request_ids=[r.request_id for r in reqs],
            num_scheduled_tokens=counts,
            samples=samples,
            num_tokens=num_tokens,
        )

    # ---- results ----------------------------------------------------------------------------

    def update(
        self, plan: StepPlan, next_tokens: np.ndarray, logprobs: np.ndarray
    ) -> list[Request]:
        """Apply a step's sampled tokens; returns the requests that gained a token this step.

        The plan already advanced every request's progress when it was built; this only delivers
        the samples. A request finished meanwhile (stop, abort) is skipped; one preempted after
        this plan was launched still receives its token (it is part of its output), then waits.
        """
        now = time.monotonic()
        progressed = []
        for i, (rid, samples) in enumerate(zip(plan.request_ids, plan.samples, strict=True)):
            req = self.requests.get(rid)
            if req is None:
                continue  # finished (stop string, abort) after this plan was built
            if req.status is RequestStatus.RUNNING:
                self._register_full_pages(req)
            if not samples:
                continue
            token = int(next_tokens[i])
            req.num_pending_tokens -= 1
            req.output_token_ids.append(token)
            if req.params.logprobs is not None:
                req.output_logprobs.append(float(logprobs[i]))
            if req.times.first_token is None:
                req.times.first_token = now
            req.times.last_token = now
            reason = self._finish_reason(req, token)
            if reason is not None:
                self.finish_request(rid, reason)
            progressed.append(req)
        return progressed

    def _register_full_pages(self, req: Request) -> None:
        """Publish pages filled by launched steps. Their tokens are all known on the host by now,
        and any later step that reads them runs after the step that writes them."""
        if not self.allocator.enable_prefix_caching:
            return
        full = min(req.num_computed_tokens, req.num_tokens) // self.page_size
        if full > req.num_registered_pages:
            hashes = self._page_hashes(req, full)
            for j in range(req.num_registered_pages, full):
                self.allocator.register(req.pages[j], hashes[j])
            req.num_registered_pages = full

    def _finish_reason(self, req: Request, token: int) -> str | None:
        p = req.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in req.eos_token_ids):
            return "stop"
        if len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.config.max_model_len:
            return "length"
        return None

    def check_invariants(self) -> None:
        """For tests: page accounting, queue states and limits hold."""
        self.allocator.check_invariants([r.pages for r in self.running])
        assert len(self.running) <= self.config.max_num_seqs
        slots = [r.slot for r in self.running]
        assert len(set(slots)) == len(slots) and None not in slots, "slots shared or missing"
        for r in self.running:
            assert r.status is RequestStatus.RUNNING
            assert len(r.pages) * self.page_size >= r.num_computed_tokens
            assert len(r.pages) <= self.config.max_pages_per_seq
            row = self.slots.page_table[r.slot]
            assert row[: len(r.pages)].tolist() == r.pages and not row[len(r.pages) :].any()
        assert not self.slots.page_table[self.slots.padding_slot].any()
        for r in list(self.waiting) + list(self.waiting_long):
            assert r.status is RequestStatus.WAITING and not r.pages and r.slot is None
