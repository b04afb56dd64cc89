"""The StepPlan: one step's work as a packed numpy buffer, for a compiled bucket."""

from __future__ import annotations

import bisect
import dataclasses

import numpy as np

from nori_jax.core.sampling_modes import SamplerProgram
from nori_jax.core.scheduler_output import SchedulerOutput
from nori_jax.core.step_layout import TOKEN_FIELDS, StepLayout


def token_buckets(max_num_batched_tokens: int, min_bucket: int = 16) -> list[int]:
    """Powers of two from `min_bucket` up to, and always including, `max_num_batched_tokens`."""
    if max_num_batched_tokens < 1:
        raise ValueError(f"max_num_batched_tokens={max_num_batched_tokens} must be >= 1")
    buckets, b = [], min(min_bucket, max_num_batched_tokens)
    while b < max_num_batched_tokens:
        buckets.append(b)
        b *= 2
    buckets.append(max_num_batched_tokens)
    return buckets


def pick_bucket(buckets: list[int], num_tokens: int) -> int:
    i = bisect.bisect_left(buckets, num_tokens)
    assert i < len(buckets), f"{num_tokens} tokens exceed the largest bucket {buckets[-1]}"
    return buckets[i]


@dataclasses.dataclass
class StepPlan:
    """The buffer the jitted step consumes (step_layout.py), and the rows it came from.

    T = token bucket, S = max_num_seqs rows. Rows are ordered decode (one query token) first,
    then prefill chunks, then padding rows (q_len 0, kv_len 0).
    """

    layout: StepLayout
    buffer: np.ndarray  # int32[layout.size]: what the device gets, in one transfer
    bucket: int  # T: the compiled forward pass it runs
    sampler: SamplerProgram
    scheduled: SchedulerOutput

    @property
    def tokens(self) -> np.ndarray:
        """int32[4, T]: the token fields, a view of `buffer`."""
        return self.layout.tokens(self.buffer, self.bucket)

    @property
    def num_steps(self) -> int:
        """Decode steps this launch runs on the device (> 1: multi-step decode)."""
        return self.scheduled.num_steps

    @property
    def num_tokens(self) -> int:
        return self.scheduled.num_tokens

    @property
    def num_rows(self) -> int:
        return self.scheduled.num_rows

    @property
    def request_ids(self) -> list[str]:
        return self.scheduled.request_ids

    @property
    def num_scheduled_tokens(self) -> list[int]:
        return self.scheduled.row_num_tokens.tolist()

    @property
    def samples(self) -> list[bool]:
        return self.scheduled.row_samples.tolist()

    def token_field(self, name: str) -> np.ndarray:
        return self.tokens[TOKEN_FIELDS.index(name)]

    def row_field(self, name: str) -> np.ndarray:
        return self.layout.view(self.buffer, name)

    # The fields by name, for tests and tools (the device reads the packed buffers).
    input_ids = property(lambda self: self.token_field("input_ids"))
    positions = property(lambda self: self.token_field("positions"))
    slot_mapping = property(lambda self: self.token_field("slot_mapping"))
    prev_index = property(lambda self: self.token_field("prev_index"))
    cu_q_lens = property(lambda self: self.row_field("cu_q_lens"))
    kv_lens = property(lambda self: self.row_field("kv_lens"))
    logits_indices = property(lambda self: self.row_field("logits_indices"))
    distribution = property(lambda self: self.row_field("distribution"))
    page_table = property(lambda self: self.row_field("page_table"))
    temperature = property(lambda self: self.row_field("temperature"))
    top_p = property(lambda self: self.row_field("top_p"))
    top_k = property(lambda self: self.row_field("top_k"))
    seeds = property(lambda self: self.row_field("seeds"))
    sample_index = property(lambda self: self.row_field("sample_index"))
    filter_rows = property(lambda self: self.row_field("filter_rows"))
    decode_steps = property(lambda self: self.row_field("decode_steps"))
