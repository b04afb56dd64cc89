"""Per-request rows of the step's arrays that persist across steps (vLLM's "persistent batch").

A running request owns one slot from admission to finish or preemption. Its page-table row and its
sampling settings are written once (pages as they are allocated), so building a StepPlan is a few
fancy-indexing operations over the scheduled slots instead of per-request array construction.
Slot `max_num_seqs` is the padding slot: an all-zero page-table row (the null page).
"""

from __future__ import annotations

import numpy as np

from nori_jax.core.request import Request


class BatchSlots:
    def __init__(self, max_num_seqs: int, max_pages_per_seq: int):
        rows = max_num_seqs + 1
        self.padding_slot = max_num_seqs
        self.page_table = np.zeros((rows, max_pages_per_seq), np.int32)  # [S + 1, MP]
        self.temperature = np.zeros(rows, np.float32)
        self.top_p = np.ones(rows, np.float32)
        self.top_k = np.zeros(rows, np.int32)
        self.seeds = np.zeros(rows, np.int32)
        self._free = list(range(max_num_seqs - 1, -1, -1))

    def acquire(self, req: Request) -> None:
        slot = self._free.pop()
        req.slot = slot
        p = req.params
        self.temperature[slot], self.top_p[slot], self.top_k[slot] = p.temperature, p.top_p, p.top_k
        self.seeds[slot] = req.seed
        self.page_table[slot, : len(req.pages)] = req.pages

    def add_pages(self, req: Request, pages: list[int]) -> None:
        """Record pages just appended to `req.pages`."""
        end = len(req.pages)
        self.page_table[req.slot, end - len(pages) : end] = pages

    def release(self, req: Request) -> None:
        if req.slot is None:
            return
        # Zero the row so a stale page id can never be read through a later occupant's table.
        self.page_table[req.slot] = 0
        self._free.append(req.slot)
        req.slot = None
