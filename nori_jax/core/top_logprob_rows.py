"""A step's top logprobs as two arrays, not a list of pairs per token.

The runner returns the K most likely tokens of each row that asked for them as int32 ids and
float32 logprobs [N, K]. Turning each row into a Python list of (id, logprob) tuples in the engine
core cost 3.3 ms a step at 1,024 rows asking for 5 (the scheduler's update, most of it per-row
numpy calls and the collector walking the lists; docs/benchmarks.md, "Host costs"), on the step
loop's critical path. So the core hands the arrays on as they are, cut to the widest `logprobs`
any listed request asked, and the output processor (in the API server's process when serving)
makes the pairs the public outputs carry: one bulk conversion per step.
"""

from __future__ import annotations

import msgspec
import numpy as np


class TopLogprobRows(msgspec.Struct, array_like=True, gc=False):
    """Row r: the token `request_ids[r]` gained in the step, its `width` most likely (id,
    logprob) pairs, best first; a request reads its own `logprobs` of them.

    One row per request: top logprobs run one step a launch (the scheduler plans no multi-step
    launch for a request asking them). The arrays travel as bytes (one buffer each)."""

    request_ids: list[str]
    width: int
    id_bytes: bytes  # int32[len(request_ids), width]
    logprob_bytes: bytes  # float32[len(request_ids), width]

    @classmethod
    def of(cls, request_ids: list[str], ids: np.ndarray, logprobs: np.ndarray) -> TopLogprobRows:
        """From [N, width] arrays (any integer / float dtypes)."""
        n = len(request_ids)
        if ids.shape != logprobs.shape or ids.ndim != 2 or ids.shape[0] != n:
            raise ValueError(
                f"top logprobs: ids {ids.shape} and logprobs {logprobs.shape} must both be "
                f"[{n}, width] for {n} request ids"
            )
        return cls(
            request_ids,
            int(ids.shape[1]),
            np.ascontiguousarray(ids, np.int32).tobytes(),
            np.ascontiguousarray(logprobs, np.float32).tobytes(),
        )

    def __len__(self) -> int:
        return len(self.request_ids)

    @property
    def ids(self) -> np.ndarray:
        return np.frombuffer(self.id_bytes, np.int32).reshape(len(self), self.width)

    @property
    def logprobs(self) -> np.ndarray:
        return np.frombuffer(self.logprob_bytes, np.float32).reshape(len(self), self.width)

    def select(self, rows: list[int]) -> TopLogprobRows:
        """The given rows, in the given order."""
        return TopLogprobRows.of(
            [self.request_ids[r] for r in rows], self.ids[rows], self.logprobs[rows]
        )

    @staticmethod
    def concat(blocks: list[TopLogprobRows | None]) -> TopLogprobRows | None:
        """The blocks' rows in order, as wide as the widest (narrower rows padded with id -1
        and -inf, which no request reads: each asked for at most its own block's width)."""
        blocks = [b for b in blocks if b is not None and len(b)]
        if len(blocks) <= 1:
            return blocks[0] if blocks else None
        width = max(b.width for b in blocks)

        def pad(a: np.ndarray, fill) -> np.ndarray:
            return np.pad(a, ((0, 0), (0, width - a.shape[1])), constant_values=fill)

        return TopLogprobRows.of(
            [rid for b in blocks for rid in b.request_ids],
            np.concatenate([pad(b.ids, -1) for b in blocks]),
            np.concatenate([pad(b.logprobs, -np.inf) for b in blocks]),
        )

    def pairs(self) -> dict[str, tuple[tuple[int, float], ...]]:
        """Per request: its row's `width` (id, logprob) pairs, a tuple as outputs carry them
        (the output processor cuts each to the request's own count). One bulk conversion of
        the arrays, then one tuple a row."""
        rows = zip(self.ids.tolist(), self.logprobs.tolist(), strict=True)
        return {
            rid: tuple(zip(ids, values, strict=True))
            for rid, (ids, values) in zip(self.request_ids, rows, strict=True)
        }
