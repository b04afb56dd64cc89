"""Continuous batching: which requests run in the next step, with how many tokens each.

Pure Python + numpy (never JAX), tested with a fake device. Each step:
  1. decodes of running requests, oldest first (one token each);
  2. chunks of running requests still prefilling (chunked prefill), page-aligned, under the budget;
  3. admission of waiting requests, FCFS, short queue first, then the long-prompt queue within its
     token share; no admission in a step that had to preempt.
When pages run out, the newest running request is preempted (pages freed, re-queued at the front
with the tokens it has, recomputed later); the engine never runs out of memory and never drops work.

Disaggregation (core/disaggregated_core.py) adds two doors. A scheduler with `hand_off` (a prefill
engine's) stops each request after its first token: it leaves the running batch for `handed_off`,
its pages kept until its KV has moved. `add_arrived` (a decode engine's) takes a request whose
prompt was computed elsewhere, its KV already in pages of this allocator; it joins the running
batch at the next step, ahead of admissions, and decodes from there.

The running batch's progress lives in `SlotCounters` (one row per slot), so a step over a thousand
decoding requests is a few numpy operations; Python touches only the rows that need something
(a new page, a prefill chunk, an admission, a finish). The output is logical rows
(`SchedulerOutput`); the plan builder lays them out as the step's arrays.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import math
import time

import numpy as np

from nori_jax.core.paging import ROOT_HASH, PageAllocator, chain_page_hashes
from nori_jax.core.request import Request, RequestStatus
from nori_jax.core.scheduler_config import SchedulerConfig
from nori_jax.core.scheduler_output import (
    Acquire,
    AddPages,
    BatchEvent,
    PrefillRow,
    PromptLogprobRows,
    Release,
    SchedulerOutput,
)
from nori_jax.core.slot_counters import SlotCounters
from nori_jax.core.step_layout import PENALTY_MARKS
from nori_jax.core.step_plan import token_buckets
from nori_jax.core.step_room import step_rooms
from nori_jax.core.top_logprob_rows import TopLogprobRows


class QueueFullError(RuntimeError):
    """The waiting queue is at `max_num_waiting`; the caller should retry later (HTTP 429)."""


@dataclasses.dataclass
class SchedulerCounters:
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache at admission
    prefix_cache_hits: int = 0  # of those, tokens found


@dataclasses.dataclass
class StepUpdate:
    """What one step's samples did: a new token per listed request, and who finished."""

    request_ids: list[str]  # requests that gained a token, in row order
    token_ids: np.ndarray  # int32[len(request_ids)]
    # float32[len(request_ids)]: each row's sampled token's logprob (None: none were given);
    # the requests that asked read theirs where their outputs are made
    logprobs: np.ndarray | None
    finished: list[Request]  # finished by these samples (stop token, length)
    first_tokens: list[Request]  # requests whose first output token this was
    # For the requests with logprobs >= 1: per token gained, its most likely (token id,
    # logprob) pairs, best first, as arrays (each request reads its own `logprobs` of them).
    top_logprobs: TopLogprobRows | None = None
    # For the requests with prompt_logprobs whose prompt's logprobs are complete with this step:
    # (each prompt token's logprob after the first, with k >= 1 its k (id, logprob) pairs, and
    # each token's rank at its position)
    prompt_logprobs: dict[
        str, tuple[list[float], list[tuple[tuple[int, float], ...]] | None, list[int]]
    ] = dataclasses.field(default_factory=dict)


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, allocator: PageAllocator, *, hand_off: bool = False
    ):
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
        self.running: list[Request] = []  # admission order: the oldest first
        # Their slots in the same order, kept beside the list as it changes (_join_running,
        # _leave_running) rather than gathered from a thousand requests every step. Replaced,
        # never written in place: `schedule` holds the step's snapshot while it preempts.
        self._running_slots = np.zeros(0, np.int64)
        # The step buffer's shared room (logit_bias entries): a request is admitted only while
        # what it needs of each fits (step_room.py).
        self._rooms = step_rooms()
        self.requests: dict[str, Request] = {}
        self.counters = SchedulerCounters()
        self.slots = SlotCounters(config.max_num_seqs)
        self._events: list[BatchEvent] = []
        self._eos_ids = np.zeros(0, np.int32)  # every request's EOS ids (for a vectorized check)
        self._by_priority = config.scheduling_policy == "priority"
        self._spare_rows = config.max_num_seqs  # logit rows left in the step being scheduled
        self._arrivals = 0  # requests added so far (Request.arrival_index)
        self._preempted_this_step = False
        self.hand_off = hand_off
        self.handed_off: collections.deque[Request] = collections.deque()  # first token sampled
        self.arrived: collections.deque[Request] = collections.deque()  # KV moved in, no slot

    # ---- queue management -------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.waiting_long)

    def has_unfinished(self) -> bool:
        return bool(
            self.running or self.waiting or self.waiting_long or self.handed_off or self.arrived
        )

    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request_id={req.request_id!r} is already in use")
        limit = self.config.max_num_waiting
        if limit is not None and self.num_waiting >= limit:
            raise QueueFullError(f"waiting queue is full ({limit} requests)")
        threshold = self.config.long_prefill_threshold
        req.is_long = threshold is not None and req.num_prompt_tokens >= threshold
        self._track(req)
        self._enqueue(req, front=False)

    def _track(self, req: Request) -> None:
        req.arrival_index = self._arrivals
        self._arrivals += 1
        if not set(req.eos_token_ids) <= set(self._eos_ids.tolist()):
            self._eos_ids = np.union1d(self._eos_ids, req.eos_token_ids).astype(np.int32)
        self.requests[req.request_id] = req

    @staticmethod
    def _rank(req: Request) -> tuple[int, int]:
        """Under the priority policy: who goes first (smallest) and who is preempted first
        (largest)."""
        return req.priority, req.arrival_index

    def _enqueue(self, req: Request, front: bool) -> None:
        """Into its waiting queue: at the back (new) or the front (preempted, recomputed) under
        FCFS; in rank order under the priority policy."""
        queue = self.waiting_long if req.is_long else self.waiting
        if self._by_priority:
            queue.insert(bisect.bisect_right(queue, self._rank(req), key=self._rank), req)
        elif front:
            queue.appendleft(req)
        else:
            queue.append(req)

    def _victim(self, candidates: list[Request]) -> Request:
        """The running request to preempt among `candidates` (admission order): the newest, or
        under the priority policy the largest rank."""
        return max(candidates, key=self._rank) if self._by_priority else candidates[-1]

    # ---- disaggregation ---------------------------------------------------------------------

    def add_arrived(self, req: Request) -> None:
        """A request whose prompt was computed elsewhere: its KV is in `req.pages` (pages of this
        allocator, already allocated, covering `req.num_computed_tokens` tokens) and its first
        token in `req.output_token_ids`. It takes a slot at the next `schedule()`."""
        if req.request_id in self.requests:
            raise ValueError(f"request_id={req.request_id!r} is already in use")
        assert req.output_token_ids and req.num_computed_tokens == req.num_tokens - 1
        assert len(req.pages) == math.ceil(req.num_computed_tokens / self.page_size)
        assert req.num_pending_tokens == 0 and req.slot is None
        req.is_long = False  # its prefill is done: no long-prompt share to count against
        req.status = RequestStatus.TRANSFER
        self._track(req)
        self.arrived.append(req)

    def add_recompute(self, req: Request) -> None:
        """A request that already has output tokens but no KV here (a transfer that fell back):
        it waits at the front of the queue and is recomputed, as after a preemption. Not bounded
        by `max_num_waiting`: it is not new work."""
        if req.request_id in self.requests:
            raise ValueError(f"request_id={req.request_id!r} is already in use")
        assert not req.pages and req.slot is None and req.num_pending_tokens == 0
        req.num_computed_tokens = req.num_registered_pages = 0
        req.is_long = False
        req.status = RequestStatus.WAITING
        self._track(req)
        self._enqueue(req, front=True)

    def has_room_for_arrival(self, num_pages: int) -> bool:
        """Could a request holding `num_pages` of KV move in now (a slot for it, its pages and the
        KV headroom free)? No while preempted requests wait here: they go first."""
        if self.num_waiting or len(self.running) + len(self.arrived) >= self.config.max_num_seqs:
            return False
        headroom = int(self.config.kv_headroom * self.allocator.num_usable_pages)
        idle = not self.running and not self.arrived
        free = self.allocator.num_free_pages
        return free >= num_pages and (idle or free - num_pages >= headroom)

    def release_handed_off(self, req: Request) -> None:
        """Its KV has moved (or it is recomputed elsewhere): free its pages here and forget it.
        Full pages stay in this engine's prefix cache."""
        self.handed_off.remove(req)
        self.allocator.free(req.pages)
        req.pages = []
        del self.requests[req.request_id]

    def _hand_off(self, req: Request) -> None:
        """A request's first token is known: it leaves the batch (or the queue) and waits."""
        if req.status is RequestStatus.RUNNING:
            self._leave_running(req)
        else:  # preempted with its first sample in flight: no KV here, the decode side recomputes
            (self.waiting_long if req.is_long else self.waiting).remove(req)
        req.status = RequestStatus.TRANSFER
        self.handed_off.append(req)

    def _admit_arrived(self) -> None:
        cfg = self.config
        while self.arrived and len(self.running) < cfg.max_num_seqs:
            if not all(room.fits(self.arrived[0]) for room in self._rooms):
                break
            req = self.arrived.popleft()
            req.status = RequestStatus.RUNNING
            self.slots.acquire(req, cfg.max_model_len)
            self._events.append(_acquire(req))
            self._join_running(req)

    def finish_request(self, request_id: str, reason: str) -> Request | None:
        """Finish a live request now (stop string, abort, timeout); frees its pages at once."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        if req.status is RequestStatus.WAITING:
            (self.waiting_long if req.is_long else self.waiting).remove(req)
        elif req.status is RequestStatus.RUNNING:
            self._leave_running(req)
        elif req.status is RequestStatus.TRANSFER:
            (self.handed_off if req in self.handed_off else self.arrived).remove(req)
        self.allocator.free(req.pages)
        req.pages = []
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.times.finished = time.monotonic()
        del self.requests[req.request_id]
        return req

    def num_computed_tokens(self, req: Request) -> int:
        """Tokens of `req` whose KV is written or being written by a launched step."""
        return (
            int(self.slots.computed[req.slot]) if req.slot is not None else req.num_computed_tokens
        )

    def _join_running(self, req: Request) -> None:
        """`req` (its slot just acquired) joins the running batch, newest."""
        self.running.append(req)
        self._running_slots = np.append(self._running_slots, req.slot)
        for room in self._rooms:
            room.used += room.need(req)

    def _leave_running(self, req: Request) -> None:
        """`req` leaves the running batch and its slot."""
        i = self.running.index(req)  # identity (Request has no __eq__)
        del self.running[i]
        slots = self._running_slots
        self._running_slots = np.concatenate((slots[:i], slots[i + 1 :]))
        for room in self._rooms:
            room.used -= room.need(req)
        self._release_slot(req)

    def _release_slot(self, req: Request) -> None:
        self._events.append(Release(req.slot))
        self.slots.release(req)

    # ---- one step ---------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput | None:
        """Pick the next step's work and advance each request as if it had run; None when idle."""
        cfg, c = self.config, self.slots
        self._preempted_this_step = False
        budget, long_budget = cfg.max_num_batched_tokens, cfg.long_prefill_budget
        if self.arrived:  # moved in with their prompt computed: they decode in this step
            self._admit_arrived()

        # 1. Decodes, oldest first: they keep every running stream moving.
        run = self._running_slots
        total = c.known[run] + c.pending[run]
        remaining = total - c.computed[run]
        done = (c.pending[run] > 0) & (total >= c.stop_at[run])  # the pending token ends it
        is_decode = (remaining == 1) & ~done
        need_page = is_decode & (c.computed[run] >= c.num_pages[run] * self.page_size)
        if need_page.any():
            epochs = c.epoch[run]
            self._decode_pages(run[need_page])
            is_decode &= c.epoch[run] == epochs  # preempted meanwhile
        decodes = run[is_decode]
        if (
            cfg.num_scheduler_steps > 1
            and 0 < len(decodes) <= cfg.multi_step_max_seqs
            and not (remaining > 1).any()
            and not self.num_waiting
            and not self.arrived
            and not self.hand_off
            # top logprobs and penalties run in programs of their own after a single step's
            # forward pass; min_tokens's banned ids are the launch's, not each inner step's
            and not c.top_logprobs[decodes].any()
            and not c.has_penalties[decodes].any()
            and not (total[is_decode] - c.prompt_len[decodes] < c.min_tokens[decodes]).any()
        ):
            steps = self._multi_step_pages(decodes)
            if steps is not None:
                return self._output(decodes, [], steps)
        budget -= len(decodes)
        scheduled = np.zeros(cfg.max_num_seqs, bool)  # per slot
        scheduled[decodes] = True
        # Logit rows left: one per row, and one per prompt position whose logprob is computed.
        self._spare_rows = cfg.max_num_seqs - len(decodes)
        self._mark_room = PENALTY_MARKS  # cached prompt ids of this step's admissions

        # 2. Running prefills (chunked), oldest first (by rank under the priority policy).
        prefills: list[tuple[Request, int]] = []
        prefilling = run[remaining > 1].tolist()
        if self._by_priority and len(prefilling) > 1:
            # (a slot emptied by a preemption in step 1 is skipped below either way)
            prefilling = [slot for slot in prefilling if c.requests[slot] is not None]
            prefilling.sort(key=lambda slot: self._rank(c.requests[slot]))
        for slot in prefilling:
            req = c.requests[slot]
            if req is None or req.status is not RequestStatus.RUNNING:
                continue  # preempted in this step
            if self._spare_rows < 1:
                break
            start = int(c.computed[slot])
            n = self._fit_prompt_logprobs(
                req, start, self._chunk_size(req, start, budget, long_budget)
            )
            if n and self._reserve(req, n, scheduled):
                prefills.append((req, n))
                scheduled[slot] = True
                budget -= n
                long_budget -= n if req.is_long else 0
                self._spare_rows -= 1 + self._prompt_positions(req, start, n)

        # 3. Admission, FCFS within each queue; never in a step that had to preempt.
        if not self._preempted_this_step:
            budget = self._admit(self.waiting, prefills, budget, long_budget)
            if budget > 0:
                used = sum(n for r, n in prefills if r.is_long)
                self._admit(self.waiting_long, prefills, budget, long_budget - used)

        if not len(decodes) and not prefills:
            return None
        return self._output(decodes, prefills)

    def _decode_pages(self, slots: np.ndarray) -> None:
        """A new page for each decode row that fills its last one (oldest first), preempting the
        newest running requests when the pool is empty (the row's own request, if it is newest)."""
        c = self.slots
        for slot in slots.tolist():
            req = c.requests[slot]
            if req is None:
                continue  # preempted for an older request in this loop
            while True:
                pages = self.allocator.allocate(1)
                if pages is not None:
                    self._add_pages(req, pages)
                    break
                victim = self._victim(self.running)
                self._preempt(victim)
                if victim is req:
                    break

    def _multi_step_pages(self, decodes: np.ndarray) -> np.ndarray | None:
        """Each decode row's steps in a multi-step launch (int32[D]), with its pages allocated;
        None when the pool cannot hold them all, or no row has more than one step to take (the
        step then runs one decode step).

        A row takes `num_scheduler_steps` steps, or fewer where its request reaches max_tokens or
        the context first: it never computes a position it has no page for. A row whose request
        stops earlier (EOS, a stop token or string) computes the rest of its steps for nothing;
        the host drops those samples.
        """
        c, ps = self.slots, self.page_size
        total = c.known[decodes] + c.pending[decodes]
        steps = np.minimum(self.config.num_scheduler_steps, c.stop_at[decodes] - total)
        if steps.max() == 1:
            return None  # every row ends after one step: a plain step costs the device less
        need = -(-(c.computed[decodes] + steps) // ps) - c.num_pages[decodes]
        if need.sum() > self.allocator.num_free_pages:
            return None
        for slot, n in zip(decodes[need > 0].tolist(), need[need > 0].tolist(), strict=True):
            self._add_pages(c.requests[slot], self.allocator.allocate(n))
        return steps.astype(np.int32)

    def _chunk_size(self, req: Request, num_computed: int, budget: int, long_budget: int) -> int:
        total = (
            int(self.slots.known[req.slot] + self.slots.pending[req.slot])
            if req.slot is not None
            else req.num_scheduled_total
        )
        remaining = total - num_computed
        n = min(remaining, budget, long_budget if req.is_long else budget)
        if 0 < n < remaining:
            # End the chunk on a page boundary when the budget allows, so every page but the last
            # of a chunk is written by one step.
            aligned = (num_computed + n) // self.page_size * self.page_size - num_computed
            if aligned > 0:
                n = aligned
        return max(n, 0)

    @staticmethod
    def _prompt_positions(req: Request, start: int, n: int) -> int:
        """Positions of a chunk [start, start + n) whose prompt logprobs it computes: those before
        the prompt's last token not planned before (a recomputation plans none twice)."""
        if req.params.prompt_logprobs is None:
            return 0
        first = max(start, req.prompt_logprobs_planned)
        return max(min(start + n, req.num_prompt_tokens - 1) - first, 0)

    def _fit_prompt_logprobs(self, req: Request, start: int, n: int) -> int:
        """`n`, or less where the chunk's prompt-logprob positions would not fit the step's logit
        rows left (`_spare_rows`, after the chunk's own row): each position takes a row of its
        own, so a request asking for them prefills at most the rows a step has to spare."""
        room = self._spare_rows - 1
        if self._prompt_positions(req, start, n) <= room:
            return n
        return max(max(start, req.prompt_logprobs_planned) + room - start, 0)

    def _add_pages(self, req: Request, pages: list[int]) -> None:
        self._events.append(AddPages(req.slot, len(req.pages), pages))
        req.pages.extend(pages)
        self.slots.num_pages[req.slot] = len(req.pages)

    def _reserve(self, req: Request, n: int, scheduled: np.ndarray) -> bool:
        """Pages for n more tokens of a running prefill, preempting newer unscheduled requests."""
        c = self.slots
        need = math.ceil((int(c.computed[req.slot]) + n) / self.page_size) - len(req.pages)
        while need > 0:
            pages = self.allocator.allocate(need)
            if pages is not None:
                self._add_pages(req, pages)
                return True
            if self._by_priority:  # only requests of a larger rank are preempted for it
                lower = [
                    v
                    for v in self.running
                    if self._rank(v) > self._rank(req) and self._preemptible(v, scheduled)
                ]
                victim = self._victim(lower) if lower else req
            else:  # only requests newer than `req` are preempted for it
                victim = next(
                    (
                        v
                        for v in reversed(self.running)
                        if v is req or self._preemptible(v, scheduled)
                    ),
                    req,
                )
            if victim is req:
                return False
            self._preempt(victim)
        return True

    def _preemptible(self, req: Request, scheduled: np.ndarray) -> bool:
        """May `req` give its pages to a prefill chunk? Not if it runs in this step, nor, on a
        prefill engine, once its prompt is computed: its KV is about to move."""
        if scheduled[req.slot]:
            return False
        c = self.slots
        return not (self.hand_off and c.computed[req.slot] >= c.prompt_len[req.slot])

    def _preempt(self, req: Request) -> None:
        self._leave_running(req)
        self.allocator.free(req.pages)
        req.pages = []
        req.num_computed_tokens = 0
        req.num_registered_pages = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        req.times.preemptions.append(time.monotonic())
        self._enqueue(req, front=True)
        self.counters.num_preemptions += 1
        self._preempted_this_step = True

    def _admit(self, queue, prefills, budget: int, long_budget: int) -> int:
        cfg = self.config
        headroom = int(cfg.kv_headroom * self.allocator.num_usable_pages)
        in_flight: set[bytes] | None = None  # built when a request first needs it
        i = 0  # the queue's head, past the requests deferred in this step
        # Per room: a request waits for it, so none that needs it passes that request.
        deferred = [False] * len(self._rooms)
        while (
            i < len(queue)
            and budget > 0
            and len(self.running) < cfg.max_num_seqs
            and self._spare_rows > 0
        ):
            req = queue[i]
            if req.is_long and self._num_long_prefilling() >= cfg.max_num_long_prefills:
                break
            assert req.num_pending_tokens == 0, "admitted with a sample in flight"
            # The running requests fill a room this request needs: it waits for some to finish.
            # Requests that need none of that room go past it meanwhile; requests that need
            # less do not, or a stream of them could keep the room taken for ever.
            waits = [
                room.need(req) > 0 and (deferred[j] or not room.fits(req))
                for j, room in enumerate(self._rooms)
            ]
            if any(waits):
                deferred = [a or b for a, b in zip(deferred, waits, strict=True)]
                i += 1
                continue
            # Reuse cached full pages, but always leave at least one token to compute: the step
            # must produce logits for the last one, and a shared page is never written.
            # (A request that needs its tokens to pass through the step reads none:
            # Request.reads_prefix_cache, penalties and prompt logprobs; one with
            # repetition_penalty that reads some sends their ids as marks.)
            reads_cache = req.reads_prefix_cache()
            hashes = self._page_hashes(req, (req.num_tokens - 1) // self.page_size)
            cached = self.allocator.lookup(hashes) if reads_cache else []
            if reads_cache and len(cached) < len(hashes) and cfg.wait_for_shared_prefix:
                if in_flight is None:
                    in_flight = self._prompt_pages_in_flight()
                if hashes[len(cached)] in in_flight:
                    # A running request is computing this request's next page: wait for it to
                    # be published rather than compute (and hold) a copy of it.
                    self.allocator.free(cached)
                    i += 1
                    continue
            marks = None
            if cached and req.params.repetition_penalty != 1.0:
                # its cached prompt tokens pass through no step: their ids go as marks
                marks = np.unique(req.token_array(0, len(cached) * self.page_size))
                if len(marks) > self._mark_room:  # no room left this step: compute them all
                    self.allocator.free(cached)
                    cached, marks = [], None
            num_cached = len(cached) * self.page_size
            n = self._fit_prompt_logprobs(
                req, num_cached, self._chunk_size(req, num_cached, budget, long_budget)
            )
            need = math.ceil((num_cached + n) / self.page_size) - len(cached)
            fits = n > 0 and (not self.running or self.allocator.num_free_pages - need >= headroom)
            new_pages = self.allocator.allocate(need) if fits else None
            if new_pages is None:
                self.allocator.free(cached)
                break
            del queue[i]
            req.pages = cached + new_pages
            req.num_computed_tokens = req.num_cached_tokens = num_cached
            req.num_registered_pages = len(cached)
            req.status = RequestStatus.RUNNING
            if req.times.first_scheduled is None:
                req.times.first_scheduled = time.monotonic()
            self.slots.acquire(req, cfg.max_model_len)
            if self.hand_off:  # stop at the first token: the pending sample ends its run here
                c = self.slots
                c.stop_at[req.slot] = min(c.stop_at[req.slot], req.num_prompt_tokens + 1)
            self._events.append(_acquire(req, marks))
            if marks is not None:
                self._mark_room -= len(marks)
            self.counters.prefix_cache_queries += req.num_tokens
            self.counters.prefix_cache_hits += num_cached
            self._join_running(req)
            prefills.append((req, n))
            budget -= n
            long_budget -= n if req.is_long else 0
            self._spare_rows -= 1 + self._prompt_positions(req, num_cached, n)
            if in_flight is not None:
                in_flight.update(self._unpublished_prompt_pages(req))
        return budget

    def _prompt_pages_in_flight(self) -> set[bytes]:
        """Prefix-cache keys of the full prompt pages that running requests compute (or have
        computed) but have not published yet."""
        c, run = self.slots, self._running_slots
        keys: set[bytes] = set()
        for slot in run[c.registered[run] < c.prompt_len[run] // self.page_size].tolist():
            keys.update(self._unpublished_prompt_pages(c.requests[slot]))
        return keys

    def _unpublished_prompt_pages(self, req: Request) -> list[bytes]:
        full = req.num_prompt_tokens // self.page_size
        return self._hash_pages(req, full)[int(self.slots.registered[req.slot]) : full]

    def _num_long_prefilling(self) -> int:
        c = self.slots
        return sum(
            1
            for r in self.running
            if r.is_long and c.known[r.slot] + c.pending[r.slot] - c.computed[r.slot] > 1
        )

    def _page_hashes(self, req: Request, num_pages: int) -> list[bytes]:
        if not self.allocator.enable_prefix_caching:
            return []
        return self._hash_pages(req, num_pages)[:num_pages]

    def _hash_pages(self, req: Request, num_pages: int) -> list[bytes]:
        """`req.page_hashes` itself, extended to at least `num_pages` keys."""
        hashes, ps = req.page_hashes, self.page_size
        have = len(hashes)
        if have < num_pages:
            parent = hashes[-1] if have else ROOT_HASH
            tokens = req.token_array(have * ps, num_pages * ps)
            assert len(tokens) == (num_pages - have) * ps, "hashing a page not yet full"
            hashes.extend(chain_page_hashes(parent, tokens, ps))
        return hashes

    def _output(
        self,
        decodes: np.ndarray,
        prefills: list[tuple[Request, int]],
        decode_steps: np.ndarray | None = None,
    ) -> SchedulerOutput:
        """The step's rows; advances each request's progress as if the step had run.
        `decode_steps`: a multi-step launch (decode rows only), each row's steps."""
        c = self.slots
        nd = len(decodes)
        pending = c.pending[decodes] > 0
        positions = c.computed[decodes].astype(np.int32)
        decode_input_ids = np.where(pending, 0, c.last_token[decodes]).astype(np.int32)
        decode_prev_index = np.where(pending, c.last_row[decodes], -1).astype(np.int32)
        decode_sample_index = (
            c.known[decodes] - c.prompt_len[decodes] + c.pending[decodes]
        ).astype(np.int32)
        advance = 1 if decode_steps is None else decode_steps
        c.computed[decodes] += advance
        c.pending[decodes] += advance
        c.last_row[decodes] = np.arange(nd, dtype=np.int32)

        # One-token chunks (a budget cut, a one-token prompt) join the decode rows, so the decode
        # segment is exactly the rows with one query token; longer chunks follow.
        ones = [(req, n) for req, n in prefills if n == 1]
        chunks = [(req, n) for req, n in prefills if n != 1]
        extra = len(ones)
        extra_slots = np.fromiter((r.slot for r, _ in ones), np.int64, extra)
        extra_ids = np.zeros(extra, np.int32)
        extra_pos = c.computed[extra_slots].astype(np.int32)
        extra_sample_index = (
            c.known[extra_slots] + c.pending[extra_slots] - c.prompt_len[extra_slots]
        ).astype(np.int32)
        samples = np.ones(nd + len(prefills), bool)
        prompt_rows: list[PromptLogprobRows] = []
        for j, (req, _) in enumerate(ones):
            start = int(extra_pos[j])
            extra_ids[j] = req.token_ids(start, start + 1)[0]
            self._plan_prompt_logprobs(req, nd + j, start, 1, prompt_rows)
            samples[nd + j] = self._advance(req.slot, 1, nd + j)

        rows: list[PrefillRow] = []
        first_chunk = nd + extra
        for j, (req, n) in enumerate(chunks):
            slot = req.slot
            start, total = int(c.computed[slot]), int(c.known[slot] + c.pending[slot])
            sample_index = total - req.num_prompt_tokens
            rows.append(PrefillRow(slot, start, req.token_array(start, start + n), sample_index))
            self._plan_prompt_logprobs(req, first_chunk + j, start, n, prompt_rows)
            samples[first_chunk + j] = self._advance(slot, n, first_chunk + j)
        chunk_slots = np.fromiter((r.slot for r in rows), np.int64, len(rows))
        row_slots = np.concatenate([decodes, extra_slots, chunk_slots]).astype(np.int32)
        row_num_tokens = np.ones(first_chunk + len(chunks), np.int32)  # not a list per decode
        row_num_tokens[first_chunk:] = [n for _, n in chunks]
        events, self._events = self._events, []
        return SchedulerOutput(
            decode_slots=np.concatenate([decodes, extra_slots]).astype(np.int32),
            decode_positions=np.concatenate([positions, extra_pos]),
            decode_input_ids=np.concatenate([decode_input_ids, extra_ids]),
            decode_prev_index=np.concatenate([decode_prev_index, np.full(extra, -1, np.int32)]),
            decode_sample_index=np.concatenate([decode_sample_index, extra_sample_index]),
            prefills=rows,
            events=events,
            row_requests=c.requests[row_slots].tolist(),
            row_slots=row_slots,
            row_epochs=c.epoch[row_slots],
            row_num_tokens=row_num_tokens,
            row_samples=samples,
            num_tokens=nd + sum(n for _, n in prefills),
            num_steps=self.config.num_scheduler_steps if decode_steps is not None else 1,
            decode_steps=decode_steps,
            top_rows=self._top_rows(samples, row_slots),
            prompt_logprobs=prompt_rows,
        )

    def _plan_prompt_logprobs(
        self, req: Request, row: int, start: int, n: int, out: list[PromptLogprobRows]
    ) -> None:
        """The chunk's prompt positions whose logprobs the step computes (`_prompt_positions`),
        each with its target, the prompt token after it."""
        count = self._prompt_positions(req, start, n)
        if count:
            first = max(start, req.prompt_logprobs_planned)
            targets = req.token_array(first + 1, first + count + 1)
            out.append(PromptLogprobRows(row, start, first, targets, req))
            req.prompt_logprobs_planned = first + count

    def _top_rows(self, samples: np.ndarray, row_slots: np.ndarray) -> np.ndarray:
        """The sampling rows of requests with logprobs >= 1 (none running: no pass over rows)."""
        asked = self.slots.top_logprobs
        if not asked.any():
            return np.zeros(0, np.int32)
        return np.flatnonzero(samples & (asked[row_slots] > 0)).astype(np.int32)

    def _advance(self, slot: int, n: int, row: int) -> bool:
        """Advance a planned chunk of n tokens; True if it ends on the last token (samples)."""
        c = self.slots
        c.computed[slot] += n
        if c.computed[slot] != c.known[slot] + c.pending[slot]:
            return False
        c.pending[slot] += 1
        c.last_row[slot] = row
        return True

    # ---- results ----------------------------------------------------------------------------

    def update(
        self,
        out: SchedulerOutput,
        next_tokens: np.ndarray,
        logprobs: np.ndarray | None = None,
        top: tuple[np.ndarray, np.ndarray] | None = None,
        prompt: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> StepUpdate:
        """Apply a step's sampled tokens (`next_tokens[i]` is row i's sample; `logprobs[i]` its
        logprob; `top` the (token ids, logprobs) [N, TOP_LOGPROBS] of the step's N rows with
        top logprobs, `out.top_rows`; `prompt` the (token ids, logprobs) [L, 1 + k] of the step's
        prompt-logprob rows, `out.prompt_logprobs`: each position's target first).

        The step already advanced every request's progress when it was planned; this delivers
        the samples. A request finished meanwhile (stop string, abort) is skipped; one preempted
        after this step was planned still receives its token (it is part of its output), then
        waits. A multi-step launch's samples are `next_tokens[step, row]` (`_update_steps`).
        """
        if out.decode_steps is not None:  # never with top logprobs (none planned multi-step)
            return self._update_steps(out, next_tokens, logprobs)
        c, now = self.slots, time.monotonic()
        slots = out.row_slots
        live = c.epoch[slots] == out.row_epochs  # still in the slot it was planned in
        if self.allocator.enable_prefix_caching:
            self._register_full_pages(slots[live])
        reqs = out.row_requests
        rows = np.flatnonzero(out.row_samples & live)
        tokens = next_tokens[rows].astype(np.int32)
        sslots = slots[rows]
        # A live row's slot still holds the request it was planned for, so the rows' output
        # lists and ids are gathered by slot (numpy takes) rather than looked up row by row
        # (the lists themselves: no attribute lookup per row).
        for output, tok in zip(c.output_lists[sslots].tolist(), tokens.tolist(), strict=True):
            output.append(tok)
        c.known[sslots] += 1
        c.pending[sslots] -= 1
        c.last_token[sslots] = tokens
        c.last_token_time[sslots] = now
        request_ids = c.request_ids[sslots].tolist()
        lps = None if logprobs is None else logprobs[rows].astype(np.float32)
        update = StepUpdate(request_ids, tokens, lps, [], [])

        for j in np.flatnonzero(c.known[sslots] - c.prompt_len[sslots] == 1).tolist():
            reqs[rows[j]].times.first_token = now
            update.first_tokens.append(reqs[rows[j]])
        if top is not None and len(out.top_rows):
            self._deliver_top(out, *top, live, update)
        if prompt is not None and out.prompt_logprobs:
            self._deliver_prompt_logprobs(out, *prompt, update)

        # Finishes: length and EOS vectorized; explicit stop ids for the rows that have them.
        ends = (c.known[sslots] >= c.stop_at[sslots]) | c.has_stop_ids[sslots]
        # A broadcast compare, not np.isin: a request has one to a few EOS ids, and isin's
        # set-up costs more than the compare.
        is_eos = (tokens[:, None] == self._eos_ids).any(axis=1)
        ends |= is_eos & ~c.ignore_eos[sslots]
        for j in np.flatnonzero(ends).tolist():
            req = reqs[rows[j]]
            reason = self._finish_reason(req, int(tokens[j]))
            if reason is not None:
                update.finished.append(self.finish_request(req.request_id, reason))
            elif self.hand_off:
                self._hand_off(req)

        # Rows whose request left its slot after this step was planned.
        for i in np.flatnonzero(out.row_samples & ~live).tolist():
            req = reqs[i]
            if req.is_finished:
                continue  # finished (stop string, abort): the sample is discarded
            tok = int(next_tokens[i])  # preempted: the token is still part of its output
            req.num_pending_tokens -= 1
            req.output_token_ids.append(tok)
            if req.times.first_token is None:
                req.times.first_token = now
                update.first_tokens.append(req)
            req.times.last_token = now
            update.request_ids.append(req.request_id)
            update.token_ids = np.append(update.token_ids, np.int32(tok))
            if update.logprobs is not None:
                update.logprobs = np.append(update.logprobs, np.float32(logprobs[i]))
            reason = self._finish_reason(req, tok)
            if reason is not None:
                update.finished.append(self.finish_request(req.request_id, reason))
            elif self.hand_off:
                self._hand_off(req)
        return update

    def _update_steps(
        self, out: SchedulerOutput, next_tokens: np.ndarray, logprobs: np.ndarray | None
    ) -> StepUpdate:
        """`update` for a multi-step launch: row i's samples are `next_tokens[:steps[i], i]`, cut
        after the first that finishes its request (a stop token or EOS; max_tokens and the
        context were already counted in `steps`). The samples after it are dropped. Vectorized
        over the rows as `update` is: Python touches a row only to extend its output list, and
        the rows that finish, asked for logprobs or were preempted meanwhile."""
        c, now = self.slots, time.monotonic()
        slots, steps, reqs = out.row_slots, out.decode_steps, out.row_requests
        live = c.epoch[slots] == out.row_epochs
        tokens = next_tokens[:, : len(slots)].astype(np.int32)  # [k, D]
        k = len(tokens)
        # Rows whose samples count: live ones, and preempted ones (not finished) keep theirs.
        preempted = [i for i in np.flatnonzero(~live).tolist() if not reqs[i].is_finished]
        # How many samples each row delivers: its steps, or through its first stop token. A
        # preempted row's slot may hold another request now: its own settings decide.
        # `_eos_ids` is every request's EOS ids together: a row that met one of them, or that
        # has stop ids, is checked against its own request's (requests may bring different EOS
        # ids), as `update` checks each finish with `_finish_reason`.
        stops = (tokens[:, :, None] == self._eos_ids).any(axis=2) & ~c.ignore_eos[slots]
        own = np.flatnonzero((stops.any(axis=0) | c.has_stop_ids[slots]) & live).tolist()
        for i in own + preempted:
            p, req = reqs[i].params, reqs[i]
            ends = list(p.stop_token_ids) + ([] if p.ignore_eos else list(req.eos_token_ids))
            stops[:, i] = np.isin(tokens[:, i], ends)
        stops[np.arange(k)[:, None] >= steps] = False
        stopped = stops.any(axis=0)
        take = np.where(stopped, stops.argmax(axis=0) + 1, steps)

        rows = np.flatnonzero(live)
        if preempted:
            rows = np.sort(np.concatenate([rows, preempted]))
        take_r = take[rows]
        by_row = tokens[:, rows].T  # [R, k]: each row's samples in order
        ids = c.request_ids[slots[rows]]
        for j, i in enumerate(rows.tolist()):
            if not live[i]:
                ids[j] = reqs[i].request_id
        for req_list, toks, n in zip(
            (reqs[i].output_token_ids for i in rows.tolist()),
            by_row.tolist(),
            take_r.tolist(),
            strict=True,
        ):
            req_list.extend(toks[:n] if n < k else toks)
        last_tokens = by_row[np.arange(len(rows)), take_r - 1]
        lr = live[rows]
        ls = slots[rows[lr]]
        # (a prefill chunk that ends one token short of its prompt decodes: its first sample can
        # come from a multi-step launch)
        first = rows[lr][c.known[ls] == c.prompt_len[ls]].tolist()
        c.known[ls] += take_r[lr]
        c.pending[ls] -= steps[rows[lr]]
        c.last_token[ls] = last_tokens[lr]
        c.last_token_time[ls] = now
        for i in preempted:
            reqs[i].num_pending_tokens -= int(steps[i])
            reqs[i].times.last_token = now
            if reqs[i].times.first_token is None:
                first.append(i)

        taken = np.arange(k)[None, :] < take_r[:, None]
        delivered = by_row[taken]  # row by row, in order
        lps = None
        if logprobs is not None:
            lps = logprobs[:, : len(slots)][:, rows].T[taken].astype(np.float32)
        update = StepUpdate(np.repeat(ids, take_r).tolist(), delivered, lps, [], [])
        for i in first:
            reqs[i].times.first_token = now
            update.first_tokens.append(reqs[i])
        if self.allocator.enable_prefix_caching:
            self._register_full_pages(slots[live])
        # Finishes: rows that stopped, reached their length, or were preempted (checked alone).
        ends = stopped[rows].copy()
        ends[lr] |= c.known[ls] >= c.stop_at[ls]
        ends[~lr] = True
        for j in np.flatnonzero(ends).tolist():
            req = reqs[rows[j]]
            reason = self._finish_reason(req, int(last_tokens[j]))
            if reason is not None:
                update.finished.append(self.finish_request(req.request_id, reason))
        return update

    def _deliver_top(
        self,
        out: SchedulerOutput,
        ids: np.ndarray,
        values: np.ndarray,
        live: np.ndarray,
        update: StepUpdate,
    ) -> None:
        """The top logprobs of the step's `top_rows` (`ids`, `values`: [N, TOP_LOGPROBS]) into
        the update as arrays (top_logprob_rows.py), cut to the widest count a listed request
        asked for. Before this step's finishes; a request that finished earlier (abort, stop
        string) gets none, one preempted after the step was planned gets its token's."""
        listed, c = out.top_rows, self.slots
        if live[listed].all():  # the common step: every listed request is in its slot
            slots = out.row_slots[listed]
            request_ids = c.request_ids[slots].tolist()
            width = int(c.top_logprobs[slots].max())
            keep = slice(None)
        else:  # some left their slot after the step was planned: asked of each request
            reqs = [out.row_requests[i] for i in listed.tolist()]
            keep = [p for p, req in enumerate(reqs) if not req.is_finished]
            request_ids = [reqs[p].request_id for p in keep]
            width = max((reqs[p].params.logprobs for p in keep), default=0)
        if request_ids:
            # Only the update carries them: the output processor keeps a request's pairs (in
            # the API process when serving), so the engine core lets them go once sent.
            update.top_logprobs = TopLogprobRows.of(
                request_ids, ids[keep, :width], values[keep, :width]
            )

    @staticmethod
    def _deliver_prompt_logprobs(
        out: SchedulerOutput, ids: np.ndarray, values: np.ndarray, update: StepUpdate
    ) -> None:
        """The step's prompt logprobs (`ids`, `values`: [L, 1 + k]: the target's rank and logprob
        first, then the top pairs) to their
        requests, in position order; a request whose prompt's are then complete goes into the
        update. One finished meanwhile (abort) takes none."""
        i = 0
        for entry in out.prompt_logprobs:
            req, n = entry.request, entry.count
            rows, i = slice(i, i + n), i + n
            if req.is_finished:
                continue
            req.prompt_logprobs.extend(values[rows, 0].astype(float).tolist())
            req.prompt_logprob_ranks.extend(ids[rows, 0].tolist())
            k = req.params.prompt_logprobs
            if k:
                req.prompt_top_logprobs.extend(  # a tuple a position, as top_logprobs
                    tuple(zip(t, v, strict=True))
                    for t, v in zip(
                        ids[rows, 1 : k + 1].tolist(),
                        values[rows, 1 : k + 1].astype(float).tolist(),
                        strict=True,
                    )
                )
            if len(req.prompt_logprobs) == req.num_prompt_tokens - 1:
                update.prompt_logprobs[req.request_id] = (
                    req.prompt_logprobs,
                    req.prompt_top_logprobs if k else None,
                    req.prompt_logprob_ranks,
                )

    def _register_full_pages(self, slots: np.ndarray) -> None:
        """Publish pages filled by launched steps. Their tokens are all known on the host by now,
        and any later step that reads them runs after the step that writes them."""
        c = self.slots
        full = np.minimum(c.computed[slots], c.known[slots]) // self.page_size
        new = full > c.registered[slots]
        if not new.any():
            return
        slots, full = slots[new], full[new]
        register = self.allocator.register
        for req, first, num_full in zip(
            c.requests[slots].tolist(), c.registered[slots].tolist(), full.tolist(), strict=True
        ):
            hashes, pages = self._hash_pages(req, num_full), req.pages
            for j in range(first, num_full):
                register(pages[j], hashes[j])
        c.registered[slots] = full

    def _finish_reason(self, req: Request, token: int) -> str | None:
        p = req.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in req.eos_token_ids):
            return "stop"
        if len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.config.max_model_len:
            return "length"
        return None

    def check_invariants(self) -> None:
        """For tests: page accounting, queue states, limits and the slot counters hold."""
        c = self.slots
        holding = self.running + list(self.handed_off) + list(self.arrived)
        self.allocator.check_invariants([r.pages for r in holding])
        assert len(self.running) <= self.config.max_num_seqs
        slots = [r.slot for r in self.running]
        assert len(set(slots)) == len(slots) and None not in slots, "slots shared or missing"
        assert self._running_slots.tolist() == slots, "running slots out of step with running"
        assert c.num_free + len(self.running) == self.config.max_num_seqs
        for room in self._rooms:
            room.check(self.running)
        for r in self.running:
            s = r.slot
            assert r.status is RequestStatus.RUNNING and c.requests[s] is r
            assert c.output_lists[s] is r.output_token_ids, "output list rebound while running"
            assert c.known[s] == r.num_tokens and c.num_pages[s] == len(r.pages)
            assert len(r.pages) * self.page_size >= c.computed[s]
            assert len(r.pages) <= self.config.max_pages_per_seq
            assert 0 <= c.pending[s] <= 2 * self.config.num_scheduler_steps
            assert c.computed[s] <= c.known[s] + c.pending[s]
        for r in list(self.waiting) + list(self.waiting_long):
            assert r.status is RequestStatus.WAITING and not r.pages and r.slot is None
        if self._by_priority:
            for queue in (self.waiting, self.waiting_long):
                ranks = [self._rank(r) for r in queue]
                assert ranks == sorted(ranks), "a waiting queue out of rank order"
        for r in list(self.handed_off) + list(self.arrived):
            assert r.status is RequestStatus.TRANSFER and r.slot is None
        assert not self.handed_off or self.hand_off


def _acquire(req: Request, prompt_marks: np.ndarray | None = None) -> Acquire:
    """The batch event of `req` taking its slot: its pages so far and sampling settings
    (`prompt_marks`: the ids of its cached prompt tokens, for its repetition_penalty)."""
    p = req.params
    return Acquire(
        req.slot,
        list(req.pages),
        p.temperature,
        p.top_p,
        p.top_k,
        req.seed,
        p.min_p,
        p.logit_bias,
        min_tokens=p.min_tokens,
        min_tokens_stop_ids=req.min_tokens_stop_ids,
        has_penalties=p.has_penalties,
        penalties=(p.presence_penalty, p.frequency_penalty, p.repetition_penalty),
        prompt_len=req.num_prompt_tokens,
        count_from=req.num_tokens,
        prompt_marks=prompt_marks,
    )
