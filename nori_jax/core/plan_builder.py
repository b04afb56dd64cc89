"""The plan builder: owns the persistent batch and lays a step's rows out as its packed buffer.

Every running request owns a slot (vLLM's "persistent batch"): its page-table row and sampling
settings are written once, as the scheduler's batch events arrive, so building a step is a few
numpy gathers over the scheduled slots. Slot `max_num_seqs` is the padding slot: an all-zero
page-table row (the null page), which every padding row reads.
"""

from __future__ import annotations

import numpy as np

from nori_jax.core.sampling_modes import choose_program, effective_temperature, normalize_top_k
from nori_jax.core.scheduler_output import Acquire, AddPages, BatchEvent, Release, SchedulerOutput
from nori_jax.core.step_layout import (
    PENALTY_FRESH,
    PENALTY_SAMPLES,
    TOKEN_FIELDS,
    TOP_LOGPROBS,
    StepLayout,
)
from nori_jax.core.step_plan import StepPlan, pick_bucket

_INPUT_IDS, _POSITIONS, _SLOT_MAPPING, _PREV_INDEX = (
    TOKEN_FIELDS.index(n) for n in ("input_ids", "positions", "slot_mapping", "prev_index")
)


class PlanBuilder:
    def __init__(
        self,
        max_num_seqs: int,
        max_pages_per_seq: int,
        page_size: int,
        num_pages: int,
        buckets: list[int],
        vocab_size: int,
    ):
        self.layout = StepLayout(max_num_seqs, max_pages_per_seq, max(buckets))
        self.page_size, self.num_pages, self.buckets = page_size, num_pages, list(buckets)
        self.vocab_size = vocab_size
        rows = max_num_seqs + 1
        self.padding_slot = max_num_seqs
        self.page_table = np.zeros((rows, max_pages_per_seq), np.int32)  # [S + 1, MP]
        self.temperature = np.zeros(rows, np.float32)
        self.top_p = np.ones(rows, np.float32)
        self.top_k = np.zeros(rows, np.int32)
        self.min_p = np.zeros(rows, np.float32)
        # slot -> (token ids, biases) of the slots whose request has a logit_bias
        self.logit_bias: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.has_logit_bias = np.zeros(rows, bool)
        self.seeds = np.zeros(rows, np.int32)
        # min_tokens: each slot's banned ids (-1 padding; widened as a longer list arrives) and
        # the output index from which they are allowed (0: none banned)
        self.banned = np.full((rows, 4), -1, np.int32)
        self.min_tokens_until = np.zeros(rows, np.int64)
        # Penalties, per slot, written at Acquire; a slot is "fresh" (the device clears its
        # counts) until the step that first carries its new request's row.
        self.has_penalties = np.zeros(rows, bool)
        self.prompt_len = np.zeros(rows, np.int32)
        self.count_from = np.zeros(rows, np.int32)
        self.penalties = np.zeros((3, rows), np.float32)  # presence, frequency, repetition
        self.fresh = np.zeros(rows, bool)
        self.marks: dict[int, np.ndarray] = {}  # slot -> its cached prompt ids, for its 1st step

    def apply(self, events: list[BatchEvent]) -> None:
        """Bring the persistent batch up to date with the scheduler's changes, in order."""
        for ev in events:
            if isinstance(ev, AddPages):
                self._write_pages(ev.slot, ev.start, ev.pages)
            elif isinstance(ev, Acquire):
                s = ev.slot
                self.page_table[s] = 0
                self._write_pages(s, 0, ev.pages)
                self.temperature[s] = effective_temperature(ev.temperature)
                self.top_p[s] = ev.top_p
                self.seeds[s] = ev.seed
                self.top_k[s] = normalize_top_k(ev.top_k, self.vocab_size)
                self.min_p[s] = ev.min_p
                self.logit_bias.pop(s, None)
                self.has_logit_bias[s] = bool(ev.logit_bias)
                if ev.logit_bias:
                    self.logit_bias[s] = (
                        np.fromiter(ev.logit_bias.keys(), np.int32, len(ev.logit_bias)),
                        np.fromiter(ev.logit_bias.values(), np.float32, len(ev.logit_bias)),
                    )
                self.min_tokens_until[s] = 0
                if ev.min_tokens and ev.min_tokens_stop_ids:
                    self._write_banned(s, ev.min_tokens_stop_ids)
                    self.min_tokens_until[s] = ev.min_tokens
                self.has_penalties[s] = self.fresh[s] = ev.has_penalties
                self.marks.pop(s, None)
                if ev.prompt_marks is not None and len(ev.prompt_marks):
                    self.marks[s] = ev.prompt_marks
                if ev.has_penalties:
                    self.prompt_len[s], self.count_from[s] = ev.prompt_len, ev.count_from
                    self.penalties[:, s] = ev.penalties
            elif isinstance(ev, Release):
                # Zero the row so a stale page id can never be read through a later occupant.
                self.page_table[ev.slot] = 0
                self.logit_bias.pop(ev.slot, None)
                self.has_logit_bias[ev.slot] = False
                self.min_tokens_until[ev.slot] = 0
                self.has_penalties[ev.slot] = False
                self.marks.pop(ev.slot, None)
            else:
                raise TypeError(f"unknown batch event {ev!r}")

    def _write_logit_bias(self, view, row_slots: np.ndarray, sample_index: np.ndarray) -> None:
        """The (row, token, bias) entries of the step's rows whose request has a logit_bias, and
        a bias of -inf on the banned ids of rows sampling below their min_tokens; the rest of the
        field stays zero (a bias of 0.0 to row 0, token 0: no change)."""
        rows = np.flatnonzero(self.has_logit_bias[row_slots])
        entries = [self.logit_bias[s] for s in row_slots[rows].tolist()]
        row_of = [np.repeat(rows, [len(t) for t, _ in entries])]
        tokens, values = [t for t, _ in entries], [v for _, v in entries]
        if self.min_tokens_until.any():  # vectorized: a thousand rows may be below their minimum
            below = self.min_tokens_until[row_slots] > sample_index[: len(row_slots)]
            under = np.flatnonzero(below)
            banned = self.banned[row_slots[under]]  # [U, W], -1 padding
            keep = banned >= 0
            row_of.append(np.repeat(under, keep.sum(axis=1)))
            tokens.append(banned[keep])
            values.append(np.full(int(keep.sum()), -np.inf, np.float32))
        n = sum(len(t) for t in tokens)
        if not n:
            return
        if n > view("bias_rows").shape[0]:  # the scheduler's admission keeps this from happening
            raise AssertionError(f"{n} logit_bias entries in one step")
        view("bias_rows")[:n] = np.concatenate(row_of)
        view("bias_tokens")[:n] = np.concatenate(tokens)
        view("bias_values")[:n] = np.concatenate(values)

    def _write_banned(self, slot: int, ids: tuple[int, ...]) -> None:
        if len(ids) > self.banned.shape[1]:
            extra = len(ids) - self.banned.shape[1]
            self.banned = np.pad(self.banned, [(0, 0), (0, extra)], constant_values=-1)
        self.banned[slot] = -1
        self.banned[slot, : len(ids)] = ids

    def _write_penalties(self, view, out: SchedulerOutput) -> None:
        """The step's rows whose request has a penalty, first in the penalty fields, with their
        slots and settings; a slot whose request is new is marked to be cleared first."""
        rows = np.flatnonzero(self.has_penalties[out.row_slots])
        if not len(rows):
            return
        slots = out.row_slots[rows]
        n = len(rows)
        view("penalty_rows")[:n] = rows
        view("penalty_slots")[:n] = slots
        view("penalty_flags")[:n] = (
            PENALTY_FRESH * self.fresh[slots] + PENALTY_SAMPLES * out.row_samples[rows]
        )
        self.fresh[slots] = False
        if self.marks:
            self._write_marks(view, slots)
        view("penalty_prompt_len")[:n] = self.prompt_len[slots]
        view("penalty_count_from")[:n] = self.count_from[slots]
        for name, values in zip(
            ("presence_penalty", "frequency_penalty", "repetition_penalty"),
            self.penalties,
            strict=True,
        ):
            view(name)[:n] = values[slots]

    def _write_marks(self, view, slots: np.ndarray) -> None:
        """The cached prompt ids of the listed rows' new requests, each with its list entry."""
        entries, tokens = view("penalty_mark_entries"), view("penalty_mark_tokens")
        k = 0
        for j, slot in enumerate(slots.tolist()):
            ids = self.marks.pop(slot, None)
            if ids is None:
                continue
            if k + len(ids) > len(tokens):  # the scheduler's mark room keeps this away
                raise AssertionError(f"{k + len(ids)} prompt marks in one step")
            entries[k : k + len(ids)] = j
            tokens[k : k + len(ids)] = ids
            k += len(ids)

    @staticmethod
    def _write_prompt_logprobs(view, out: SchedulerOutput, cu_q_lens: np.ndarray) -> None:
        """Each prompt-logprob position in a logit row of its own after the step's rows: that
        row's `logits_indices` is the position's token, its target the prompt token after it."""
        rows, targets = view("prompt_logprob_rows"), view("prompt_logprob_targets")
        logits_indices = view("logits_indices")
        spare, k, top = out.num_rows, 0, 0
        for e in out.prompt_logprobs:
            n = e.count
            if spare + k + n > len(logits_indices):  # the scheduler's row count keeps this away
                raise AssertionError(f"{spare + k + n} logit rows in one step")
            logit_rows = np.arange(spare + k, spare + k + n)
            base = cu_q_lens[e.row] + (e.first - e.chunk_start)
            logits_indices[logit_rows] = base + np.arange(n)
            rows[k : k + n] = logit_rows
            targets[k : k + n] = e.targets
            k += n
            top = max(top, e.request.params.prompt_logprobs)
        view("prompt_logprob_top")[0] = 0 if top == 0 else 1 if top == 1 else TOP_LOGPROBS

    def _write_pages(self, slot: int, start: int, pages: list[int]) -> None:
        if not pages:
            return
        # JAX clips out-of-range indices silently, which would corrupt another request's KV.
        if min(pages) <= 0 or max(pages) >= self.num_pages:
            raise AssertionError(f"page ids {pages} outside [1, {self.num_pages})")
        self.page_table[slot, start : start + len(pages)] = pages

    def build(self, out: SchedulerOutput) -> StepPlan:
        """The step's buffer for `out` (apply its events first), for the bucket that holds it."""
        self.apply(out.events)
        layout, ps = self.layout, self.page_size
        s, nd, nrows = layout.max_num_seqs, out.num_decodes, out.num_rows
        # Each prompt-logprob position takes a logit row past the step's rows, and a bucket of T
        # tokens computes at most T rows.
        extra = sum(e.count for e in out.prompt_logprobs)
        bucket = pick_bucket(self.buckets, max(out.num_tokens, out.num_rows + extra))
        buffer = layout.new_step()
        tokens = layout.tokens(buffer, bucket)
        view = lambda name: layout.view(buffer, name)  # noqa: E731

        row_slots = np.full(s, self.padding_slot, np.int32)
        row_slots[:nrows] = out.row_slots
        # Only the real rows' page-table rows: the padding rows stay as new_step() made them,
        # zero, which is the padding slot's row. mode="clip" (the slots are all in range): with
        # `out=`, take's default mode "raise" copies through a temporary buffer, and this is the
        # largest copy of the step (max_num_seqs x max_pages_per_seq).
        page_table = view("page_table")
        np.take(self.page_table, out.row_slots, axis=0, out=page_table[:nrows], mode="clip")
        start = np.zeros(s, np.int32)
        start[:nd] = out.decode_positions
        q_lens = np.zeros(s, np.int32)
        q_lens[:nrows] = out.row_num_tokens
        sample_index = view("sample_index")
        sample_index[:nd] = out.decode_sample_index
        if out.decode_steps is not None:
            view("decode_steps")[:nd] = out.decode_steps

        # Decode rows, vectorized: one token each. Its id is the last known token, or, when the
        # previous step's sample has not reached the host yet, a placeholder the device fills
        # from that step's output (prev_index).
        dec = out.decode_slots
        pos = out.decode_positions
        tokens[_INPUT_IDS, :nd] = out.decode_input_ids
        tokens[_POSITIONS, :nd] = pos
        # The page ids by flat index into the table (a 1-D take: cheaper than the 2-D fancy
        # index over a thousand rows), one divmod for page and offset.
        page, offset_in_page = np.divmod(pos, ps)
        flat = self.page_table.ravel().take(dec * self.page_table.shape[1] + page)
        tokens[_SLOT_MAPPING, :nd] = flat * ps + offset_in_page
        tokens[_PREV_INDEX, :nd] = out.decode_prev_index
        # Prefill chunks: few rows, many tokens each.
        offset = nd
        for i, row in enumerate(out.prefills, start=nd):
            n = len(row.token_ids)
            p = np.arange(row.start, row.start + n, dtype=np.int32)
            tokens[_INPUT_IDS, offset : offset + n] = row.token_ids
            tokens[_POSITIONS, offset : offset + n] = p
            tokens[_SLOT_MAPPING, offset : offset + n] = (
                self.page_table[row.slot, p // ps] * ps + p % ps
            )
            start[i] = row.start
            sample_index[i] = row.sample_index
            offset += n

        view("kv_lens")[:] = start + q_lens
        cu_q_lens = view("cu_q_lens")
        np.cumsum(q_lens, out=cu_q_lens[1:])
        view("logits_indices")[:] = np.maximum(cu_q_lens[1:] - 1, 0)
        if out.prompt_logprobs:
            self._write_prompt_logprobs(view, out, cu_q_lens)
        view("distribution")[:] = (nd, nrows)
        temperature, top_p, top_k = view("temperature"), view("top_p"), view("top_k")
        np.take(self.temperature, row_slots, out=temperature, mode="clip")
        np.take(self.top_p, row_slots, out=top_p, mode="clip")
        np.take(self.top_k, row_slots, out=top_k, mode="clip")
        min_p = view("min_p")
        np.take(self.min_p, row_slots, out=min_p, mode="clip")
        np.take(self.seeds, row_slots, out=view("seeds"), mode="clip")
        program, filtered = choose_program(
            temperature[:nrows], top_p[:nrows], top_k[:nrows], s, min_p[:nrows]
        )
        if self.logit_bias or self.min_tokens_until.any():
            self._write_logit_bias(view, out.row_slots, sample_index)
        if self.has_penalties.any():
            self._write_penalties(view, out)
        filter_rows = view("filter_rows")
        filter_rows[:] = s  # padding: out of range, dropped by the sampler's scatter
        filter_rows[: len(filtered)] = filtered
        # (max_num_seqs entries, one per row at most; the rest stay max_num_seqs from new_step,
        # and a step listing none runs no top-logprobs program)
        view("top_rows")[: len(out.top_rows)] = out.top_rows
        return StepPlan(layout, buffer, bucket, program, out)
