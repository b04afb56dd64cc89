"""What a step holds, as the numbers its cost depends on, read from the step's packed buffers.

The device time of a step grows with: the padded token bucket (every matmul runs over it), the KV
its decode rows read, the (query, key) pairs of its prefill chunks (causal attention over the
chunk and the context before it) and its number of rows. The host's work grows with rows and
tokens. Both the simulator and the calibration take them from the StepPlan the plan builder
produced (its scheduler rows; a test checks they equal what its packed buffers tell the device).

`DERIVED` features are functions of those fields, usable as model terms too:
`mixed_decode_kv_tokens` is the decode rows' KV of a step that also runs prefill chunks (0 in a
decode-only step). Steps that mix a large decode batch with a chunk ran longer on the H200 than
the sum of their decode and prefill parts (docs/planning.md, "How close it is"); `plan
calibrate` profiles mixed steps with up to max_num_seqs - 1 decoders and fits the term to them.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from nori_jax.core.step_plan import StepPlan


@dataclasses.dataclass(frozen=True)
class StepFeatures:
    bucket: int  # T: padded tokens run through the model
    num_tokens: int  # real tokens (<= bucket)
    num_rows: int  # requests in the step
    num_decodes: int  # rows with one query token (decodes and one-token chunks)
    prefill_tokens: int  # tokens of the longer chunks
    decode_kv_tokens: int  # KV tokens the decode rows attend to (sum of their kv_lens)
    prefill_pairs: int  # (query, key) pairs the chunks attend to, causal

    def __post_init__(self) -> None:
        if not 0 <= self.num_tokens <= self.bucket:
            raise ValueError(
                f"need 0 <= num_tokens <= bucket, got {self.num_tokens=} {self.bucket=}"
            )
        if not 0 <= self.num_decodes <= self.num_rows:
            raise ValueError(f"need 0 <= num_decodes <= num_rows, got {self}")

    @property
    def mixed_decode_kv_tokens(self) -> int:
        return self.decode_kv_tokens if self.prefill_tokens else 0


DERIVED = ("mixed_decode_kv_tokens",)  # properties of StepFeatures that may be model terms


def step_features(plan: StepPlan) -> StepFeatures:
    """From the scheduler's rows (what the buffers are built from; cheaper than reading them)."""
    out = plan.scheduled
    nd = out.num_decodes
    q = np.fromiter((len(r.token_ids) for r in out.prefills), np.int64, len(out.prefills))
    kv = np.fromiter((r.start for r in out.prefills), np.int64, len(out.prefills)) + q
    return StepFeatures(
        bucket=plan.bucket,
        num_tokens=out.num_tokens,
        num_rows=out.num_rows,
        num_decodes=nd,
        prefill_tokens=int(q.sum()),
        decode_kv_tokens=int(out.decode_positions.sum()) + nd,  # kv_len = position + 1
        prefill_pairs=_causal_pairs(q, kv),
    )


def step_features_from_buffers(plan: StepPlan) -> StepFeatures:
    """The same numbers read from the packed buffers the device is given."""
    rows = plan.num_rows
    num_decodes = int(plan.distribution[0])
    q = np.diff(plan.cu_q_lens[: rows + 1]).astype(np.int64)
    kv = plan.kv_lens[:rows].astype(np.int64)
    return StepFeatures(
        bucket=plan.bucket,
        num_tokens=int(plan.cu_q_lens[rows]),
        num_rows=rows,
        num_decodes=num_decodes,
        prefill_tokens=int(q[num_decodes:].sum()),
        decode_kv_tokens=int(kv[:num_decodes].sum()),
        prefill_pairs=_causal_pairs(q[num_decodes:], kv[num_decodes:]),
    )


def _causal_pairs(q: np.ndarray, kv: np.ndarray) -> int:
    # Query i of a chunk ending at kv_len sees (kv_len - q + i + 1) keys: q*kv - q*(q-1)/2 in all.
    return int((q * kv - q * (q - 1) // 2).sum())
