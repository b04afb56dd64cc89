"""The schema of the step's input buffer, declared once: what the host packs, what the device reads.

A step's metadata travels as one int32 host buffer, one transfer (`StepLayout.size` elements, the
same for every bucket, so every program of the step reads the same device buffer):

    tokens  int32[4, C]  per token: input_ids, positions, slot_mapping, prev_index, with room for
                         C = max_num_batched_tokens (rounded up); a bucket of T tokens uses the
                         first T of each and the device slices them off statically
    rows    per row (S = max_num_seqs) and the page table, flat (offsets below)

Float fields travel as their int32 bit patterns. Every field starts on a 256-byte boundary: XLA
hands a slice of a parameter to a custom call as a sub-buffer, and the Mosaic GPU kernel refuses
inputs that are not 256-byte aligned. A small bucket carries the unused token room (at most
16 x C bytes) in exchange for one transfer and one shape for the forward passes, the sampler
programs and the multi-step programs alike. The executor unpacks the buffer with static slices
(`executor/step_inputs.py`); tests and the host read fields through `StepLayout.view` and
`StepLayout.tokens`.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from nori_jax.sampling_params import MAX_LOGPROBS

TOKEN_FIELDS = ("input_ids", "positions", "slot_mapping", "prev_index")
FIELD_ALIGN = 64  # int32 elements: 256 bytes
# logit_bias entries (row, token, bias) of one step, all rows together: the scheduler admits a
# request only while the running requests' entries fit (scheduler.py), so none is ever dropped.
LOGIT_BIAS_CAPACITY = 2048
# Top logprobs: a step lists its sampling rows whose request has logprobs >= 1 (`top_rows`, any
# number of them); a program of its own computes their TOP_LOGPROBS most likely tokens with their
# logprobs, in a fresh output copied back only in such steps (executor/runner.py).
TOP_LOGPROBS = MAX_LOGPROBS  # per listed row: a request takes any number up to it
# Penalties (presence, frequency, repetition): the device keeps each slot's token counts between
# steps (executor/penalties.py); a step lists its rows whose request has a penalty, first, with
# these flags: the slot's request is new (its counts are cleared first); the row samples in this
# step (its token is counted after sampling).
PENALTY_FRESH, PENALTY_SAMPLES = 1, 2
# A request with repetition_penalty whose prompt's first pages come from the prefix cache: those
# tokens never pass through a step, so its first step carries their distinct ids ("marks") for its
# slot's prompt table; all of one step's admissions together fit this room (else the request
# computes its whole prompt instead of reading the cache).
PENALTY_MARKS = 1024
# input_ids: int32[T]; positions: int32[T]; slot_mapping: int32[T] (page * page_size + offset,
# padding writes go to page 0); prev_index: int32[T], for a token whose id is still on the
# device (sampled by the previous step) the row of that step whose sample it is, else -1.


def _aligned(size: int) -> int:
    return -(-size // FIELD_ALIGN) * FIELD_ALIGN


@dataclasses.dataclass(frozen=True)
class Field:
    name: str
    offset: int
    shape: tuple[int, ...]
    dtype: type  # np.int32 or np.float32

    @property
    def size(self) -> int:
        return math.prod(self.shape)  # not np.prod: read by every view, a dozen per step


@dataclasses.dataclass(frozen=True)
class StepLayout:
    """Offsets of every field for a batch of `max_num_seqs` rows and buckets of at most
    `max_num_batched_tokens` tokens."""

    max_num_seqs: int
    max_pages_per_seq: int
    max_num_batched_tokens: int

    @functools.cached_property
    def token_capacity(self) -> int:
        """C: the room each token field has (the largest bucket, aligned)."""
        return _aligned(self.max_num_batched_tokens)

    @functools.cached_property
    def row_fields(self) -> tuple[Field, ...]:
        s, mp = self.max_num_seqs, self.max_pages_per_seq
        specs = (
            ("cu_q_lens", (s + 1,), np.int32),  # row i's tokens are [cu[i], cu[i+1])
            ("kv_lens", (s,), np.int32),  # KV length after this step's tokens
            ("logits_indices", (s,), np.int32),  # each row's last token
            ("distribution", (2,), np.int32),  # (num_decode_rows, num_rows)
            ("temperature", (s,), np.float32),  # 0 = greedy
            ("top_p", (s,), np.float32),
            ("top_k", (s,), np.int32),  # 0 = off
            ("min_p", (s,), np.float32),  # 0 = off
            ("seeds", (s,), np.int32),
            ("sample_index", (s,), np.int32),  # output index a row samples (its RNG stream)
            # Rows whose min-p / top-k / top-p filter the sampler computes (sampling_modes.py), then
            # padding (= max_num_seqs, dropped).
            ("filter_rows", (s,), np.int32),
            # A multi-step launch (StepPlan.num_steps > 1): how many of its decode steps the
            # row computes; its later steps write the null page and their samples are dropped.
            ("decode_steps", (s,), np.int32),
            # logit_bias entries: a bias added to logits[row, token]; unused entries add 0.0.
            ("bias_rows", (LOGIT_BIAS_CAPACITY,), np.int32),
            ("bias_tokens", (LOGIT_BIAS_CAPACITY,), np.int32),
            ("bias_values", (LOGIT_BIAS_CAPACITY,), np.float32),
            # rows whose top logprobs the step computes, in row order; then max_num_seqs
            ("top_rows", (s,), np.int32),
            # The step's rows whose request has a penalty (then max_num_seqs), and for each its
            # slot, flags, prompt length (its tokens below it are the prompt's), the position
            # from which its tokens were sampled on the device (below it, already-generated
            # tokens recomputed after a preemption are counted as they pass) and its penalties.
            ("penalty_rows", (s,), np.int32),
            ("penalty_slots", (s,), np.int32),
            ("penalty_flags", (s,), np.int32),
            ("penalty_prompt_len", (s,), np.int32),
            ("penalty_count_from", (s,), np.int32),
            ("presence_penalty", (s,), np.float32),
            ("frequency_penalty", (s,), np.float32),
            ("repetition_penalty", (s,), np.float32),
            # marks: each a token id of a listed row's cached prompt, and that row's index in
            # the list (max_num_seqs: unused)
            ("penalty_mark_entries", (PENALTY_MARKS,), np.int32),
            ("penalty_mark_tokens", (PENALTY_MARKS,), np.int32),
            # Prompt logprobs: logit rows past the step's own rows whose `logits_indices` point
            # at prompt positions of requests asking for them (compact, then max_num_seqs), and
            # each one's target, the prompt token after that position.
            ("prompt_logprob_rows", (s,), np.int32),
            ("prompt_logprob_targets", (s,), np.int32),
            # how many most likely tokens the step returns with them: 0, 1 or TOP_LOGPROBS
            ("prompt_logprob_top", (1,), np.int32),
            ("page_table", (s, mp), np.int32),
        )
        fields, offset = [], len(TOKEN_FIELDS) * self.token_capacity
        for name, shape, dtype in specs:
            fields.append(Field(name, offset, shape, dtype))
            offset += _aligned(math.prod(shape))
        return tuple(fields)

    @functools.cached_property
    def size(self) -> int:
        """Elements of the whole step buffer (a multiple of FIELD_ALIGN)."""
        last = self.row_fields[-1]
        return last.offset + _aligned(last.size)

    @functools.cached_property
    def _by_name(self) -> dict[str, Field]:
        return {f.name: f for f in self.row_fields}

    def field(self, name: str) -> Field:
        return self._by_name[name]

    def new_step(self) -> np.ndarray:
        """A zeroed step buffer; prev_index starts at -1 (every id known), the top-logprobs,
        penalty and prompt-logprob row lists empty (max_num_seqs)."""
        buf = np.zeros(self.size, np.int32)
        self.tokens(buf)[TOKEN_FIELDS.index("prev_index")] = -1
        self.view(buf, "top_rows")[:] = self.max_num_seqs
        self.view(buf, "penalty_rows")[:] = self.max_num_seqs
        self.view(buf, "penalty_slots")[:] = self.max_num_seqs
        self.view(buf, "penalty_mark_entries")[:] = self.max_num_seqs
        self.view(buf, "prompt_logprob_rows")[:] = self.max_num_seqs
        return buf

    def tokens(self, buf: np.ndarray, bucket: int | None = None) -> np.ndarray:
        """A writable int32[4, bucket] view of the token fields (all their room by default)."""
        c = self.token_capacity
        return buf[: len(TOKEN_FIELDS) * c].reshape(len(TOKEN_FIELDS), c)[:, :bucket]

    def view(self, buf: np.ndarray, name: str) -> np.ndarray:
        """A writable numpy view of one per-row field of a host step buffer."""
        f = self.field(name)
        flat = buf[f.offset : f.offset + f.size]
        if f.dtype is np.float32:
            flat = flat.view(np.float32)
        return flat.reshape(f.shape)
