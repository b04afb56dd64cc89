"""The scheduler's counters of running requests, one row per slot (a structure of arrays).

A running request owns a slot from admission to finish or preemption. While it runs, the counters
here are the truth about its progress (the `Request` object keeps the cold state: tokens, pages,
parameters), so the per-step work over the whole running batch is a few numpy operations rather
than a Python loop over request objects. When a request leaves the running batch its progress is
written back to the `Request` (`Scheduler._release_slot`).
"""

from __future__ import annotations

import numpy as np

from nori_jax.core.request import Request


class SlotCounters:
    def __init__(self, num_slots: int):
        n = num_slots
        i64 = np.int64
        self.computed = np.zeros(n, i64)  # tokens whose KV is written or being written
        self.known = np.zeros(n, i64)  # prompt + fetched output tokens
        # Sampled by launched steps, not yet fetched: up to 2 while step N+1 is planned before
        # step N's sample is delivered (overlapped scheduling).
        self.pending = np.zeros(n, i64)
        self.prompt_len = np.zeros(n, i64)
        self.stop_at = np.zeros(n, i64)  # known-token count that ends it: max_tokens or context
        self.num_pages = np.zeros(n, i64)
        self.registered = np.zeros(n, i64)  # leading full pages published to the prefix cache
        self.last_token = np.zeros(n, np.int32)  # last known token id
        self.last_row = np.full(n, -1, np.int32)  # the row of the last plan that sampled for it
        self.epoch = np.zeros(n, i64)  # bumped on every release: a row of an older epoch is stale
        self.ignore_eos = np.zeros(n, bool)
        self.has_stop_ids = np.zeros(n, bool)
        # `logprobs` where >= 1 (top pairs per token); 0 below, without them and on a free slot
        self.top_logprobs = np.zeros(n, np.int8)
        self.has_penalties = np.zeros(n, bool)  # a penalty place
        self.min_tokens = np.zeros(n, i64)
        self.last_token_time = np.zeros(n, np.float64)
        # Object arrays, so a step gathers its rows' requests (and ids) with one numpy take
        # instead of a Python loop over a thousand rows.
        self.requests = np.full(n, None, object)  # Request | None per slot
        self.request_ids = np.full(n, None, object)  # str | None per slot
        # The occupant's `output_token_ids` list (the same object: a request's list is never
        # rebound), which `Scheduler.update` appends each step's tokens to.
        self.output_lists = np.full(n, None, object)
        self._free = list(range(n - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def acquire(self, req: Request, max_model_len: int) -> int:
        slot = self._free.pop()
        p = req.params
        self.computed[slot] = req.num_computed_tokens
        self.known[slot] = req.num_tokens
        self.pending[slot] = req.num_pending_tokens
        self.prompt_len[slot] = req.num_prompt_tokens
        self.stop_at[slot] = min(req.num_prompt_tokens + p.max_tokens, max_model_len)
        self.num_pages[slot] = len(req.pages)
        self.registered[slot] = req.num_registered_pages
        self.last_token[slot] = req.last_token
        self.last_row[slot] = req.last_row
        self.ignore_eos[slot] = p.ignore_eos
        self.has_stop_ids[slot] = bool(p.stop_token_ids)
        self.top_logprobs[slot] = p.logprobs or 0
        self.has_penalties[slot] = p.has_penalties
        self.min_tokens[slot] = p.min_tokens
        self.last_token_time[slot] = req.times.last_token or 0.0
        self.requests[slot] = req
        self.request_ids[slot] = req.request_id
        self.output_lists[slot] = req.output_token_ids
        req.slot = slot
        return slot

    def release(self, req: Request) -> None:
        """Write the request's progress back and free its slot."""
        slot = req.slot
        req.num_computed_tokens = int(self.computed[slot])
        req.num_pending_tokens = int(self.pending[slot])
        req.num_registered_pages = int(self.registered[slot])
        req.last_row = int(self.last_row[slot])
        if self.last_token_time[slot]:
            req.times.last_token = float(self.last_token_time[slot])
        self.requests[slot] = None
        self.request_ids[slot] = None
        self.output_lists[slot] = None
        self.top_logprobs[slot] = 0  # so that `.any()` says whether a running one asks
        self.epoch[slot] += 1
        self._free.append(slot)
        req.slot = None
