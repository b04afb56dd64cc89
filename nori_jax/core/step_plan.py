"""The StepPlan: one step's work as plain numpy arrays already padded to a compiled bucket."""

from __future__ import annotations

import bisect
import dataclasses

import numpy as np


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
    """Arrays the jitted step consumes, plus host bookkeeping the scheduler reads back.

    T = token bucket, S = max_num_seqs rows, MP = max pages per sequence. Rows are ordered decode
    (one query token) first, then prefill chunks, then padding rows (q_len 0, kv_len 0).
    """

    input_ids: np.ndarray  # int32[T]
    positions: np.ndarray  # int32[T]
    slot_mapping: np.ndarray  # int32[T]; padding writes go to page 0
    cu_q_lens: np.ndarray  # int32[S + 1]
    kv_lens: np.ndarray  # int32[S]
    page_table: np.ndarray  # int32[S, MP]
    distribution: np.ndarray  # int32[2]: (num_decode_rows, num_rows)
    logits_indices: np.ndarray  # int32[S]: last token of each row
    temperature: np.ndarray  # float32[S]
    top_p: np.ndarray  # float32[S]
    top_k: np.ndarray  # int32[S]; 0 = off
    seeds: np.ndarray  # int32[S]
    sample_index: np.ndarray  # int32[S]: index of the output token a row samples (RNG stream)
    # int32[T]: for a token whose id is still on the device (sampled by the previous step), the
    # row of that step whose sample it is; -1 where input_ids holds the real id.
    prev_index: np.ndarray
    # Host-side bookkeeping (not sent to the device).
    request_ids: list[str]  # per real row
    num_scheduled_tokens: list[int]  # per real row
    samples: list[bool]  # per real row: does this row's last token produce an output token?
    num_tokens: int  # real tokens (<= T)

    @property
    def bucket(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_rows(self) -> int:
        return len(self.request_ids)

    def device_arrays(self) -> dict[str, np.ndarray]:
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), np.ndarray)
        }
