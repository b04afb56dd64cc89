"""Block sizes of the skinny matmul, chosen per shape (JAX-free)."""

from __future__ import annotations

import dataclasses

ROWS = 128  # weight rows (output features) per CTA: two compute warpgroups of wgmma's 64 rows
ROW_BYTES = 128  # a block's contracted extent in bytes: one 128-byte swizzled row per operand row
# Per CTA: one CTA per SM with a deep pipeline. The H200 sweep (docs/benchmarks.md, "The skinny
# matmul") ran fp8 at 16 and 64 tokens fastest with 4-6 stages, where a 96 KiB budget (two CTAs
# per SM) allowed 2-4 and ran up to 1.4x slower.
SMEM_BUDGET = 200 * 1024
MAX_STAGES = 6
EPILOGUE_TOKENS = 32  # at most this many token columns per partial-sum store (kernel.py)


@dataclasses.dataclass(frozen=True)
class SkinnyTuning:
    block_k: int  # contracted elements per pipeline step
    stages: int  # pipeline steps in flight
    splits: int  # the contracted axis split over this many CTAs (partial sums added after)


def default_tuning(
    num_tokens: int,
    in_features: int,
    out_features: int,
    itemsize: float,
    num_sms: int = 132,
    x_itemsize: int | None = None,
    block_k: int | None = None,
) -> SkinnyTuning:
    """Enough CTAs for two per SM (two waves), each streaming at least four blocks; stages to
    fill the CTA's shared memory. `itemsize`: the weight's bytes per element (0.5 for int4);
    `x_itemsize`: the tokens' (integer weights take bf16 tokens; default: the weight's);
    `block_k`: the contracted block, where group scales fix it to their group (default: a
    128-byte row of the weight)."""
    block_k = block_k or int(ROW_BYTES / itemsize)
    steps = in_features // block_k
    tiles = out_features // ROWS
    splits = 1
    while (
        tiles * splits < 2 * num_sms
        and steps % (splits * 2) == 0
        and steps // (splits * 2) >= 4
        # the partial sums (written and read back as float32) stay under a quarter of the weight
        # (the sweep's fastest 64-token down projection wrote a seventh)
        and splits * 2 * num_tokens * 4 * 4 <= in_features * itemsize
    ):
        splits *= 2
    # a block of weight rows, and the tokens' block over the same contracted elements
    stage_bytes = int(ROWS * block_k * itemsize + num_tokens * block_k * (x_itemsize or itemsize))
    out_bytes = ROWS * 2 * epilogue_tokens(num_tokens) * 4
    stages = max(2, min(MAX_STAGES, (SMEM_BUDGET - out_bytes) // stage_bytes, steps // splits))
    return SkinnyTuning(block_k, stages, splits)


def epilogue_tokens(num_tokens: int) -> int:
    """Token columns per partial-sum store: the largest multiple of 8 up to EPILOGUE_TOKENS that
    divides the token count (a multiple of 8)."""
    return next(c for c in range(EPILOGUE_TOKENS, 0, -8) if num_tokens % c == 0)
