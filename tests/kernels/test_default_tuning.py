"""default_tuning: every schedule it picks fits a Hopper CTA's shared memory, and it takes the
forms the H200 measured faster (docs/benchmarks.md, kernel runs 5 to 7)."""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import pytest

from pallas_kernels.ragged_paged_attention.tuning import default_tuning

SHAPES = list(
    itertools.product(
        (64, 128),  # head_dim
        (16, 64, 256),  # page_size
        (1, 32, 256, 512),  # sequences
        (1, 8),  # kv heads
        (16, 4096),  # token bucket: decode-heavy, prefill-heavy
        (jnp.bfloat16, jnp.float16),
    )
)


@pytest.mark.parametrize("head_dim,page_size,num_seqs,num_kv_heads,num_tokens,dtype", SHAPES)
def test_default_tuning_fits_and_takes_the_measured_forms(
    head_dim, page_size, num_seqs, num_kv_heads, num_tokens, dtype
):
    tn = default_tuning(
        num_seqs=num_seqs,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        pages_per_seq=8192 // page_size,
        dtype=dtype,
        num_tokens=num_tokens,
    )
    tn.check_fits(head_dim, page_size, dtype)  # ValueError if SMEM or block/page tiling fails
    # head_dim-64 prefill buckets: three compute warpgroups, 128 x 2 blocks, no ping-pong, row
    # sums on the tensor cores; otherwise two, with ping-pong, row sums by adds.
    three = head_dim == 64 and num_tokens >= 2048
    assert tn.compute_wgs == (3 if three else 2)
    assert tn.pingpong == (not three)
    assert tn.mma_row_sums == three
    if three:
        assert (tn.block_kv, tn.num_stages, tn.decode_splits) == (128, 2, 1)
    # Two warpgroups take decode items exactly where decode is not split, and four producer
    # warps share the copies there and in every prefill bucket (the measured forms).
    assert tn.decode_wgs == (2 if tn.decode_splits == 1 else 1)
    assert tn.producer_warps == (4 if tn.decode_splits == 1 or num_tokens >= 2048 else 1)


@pytest.mark.parametrize(
    "num_seqs,pages_per_seq,expected",
    [
        # Batch 256 x ctx 1024: 128-token blocks x 2 stages, no splits, both warpgroups, four
        # producer warps (docs/benchmarks.md, kernel runs 5 and 6).
        (256, 64, (128, 2, 1, 2, 4)),
        # Batch 32 x ctx 8192: splits; their staging leaves no room for 128 x 2, so 64 x 3, one
        # decode warpgroup and one producer thread.
        (32, 512, (64, 3, 2, 1, 1)),
    ],
    ids=["headline", "small-batch"],
)
def test_head_dim_128_decode_picks(num_seqs, pages_per_seq, expected):
    """32q/8kv/128, page 16, bf16, a decode bucket (one token per sequence)."""
    tn = default_tuning(
        num_seqs=num_seqs,
        num_kv_heads=8,
        head_dim=128,
        page_size=16,
        pages_per_seq=pages_per_seq,
        dtype=jnp.bfloat16,
        num_tokens=num_seqs,
    )
    picked = (tn.block_kv, tn.num_stages, tn.decode_splits, tn.decode_wgs, tn.producer_warps)
    assert picked == expected


@pytest.mark.parametrize(
    "num_q_heads,num_kv_heads,num_tokens,expected",
    [
        (9, 3, 2048, 4),  # 33 tiles of 63 tokens x 3 kv heads: 99 items for 132 SMs
        (9, 3, 4096, 1),  # 198 items
        (32, 8, 2048, 1),  # 43 tiles of 48 tokens x 8 kv heads: 344 items
        (None, 3, 2048, 1),  # q heads unknown: no guess
    ],
)
def test_prefill_kv_splits_where_tiles_are_fewer_than_sms(
    num_q_heads, num_kv_heads, num_tokens, expected
):
    tn = default_tuning(
        num_seqs=8,
        num_kv_heads=num_kv_heads,
        head_dim=64,
        page_size=16,
        pages_per_seq=512,
        dtype=jnp.bfloat16,
        num_ctas=132,
        num_tokens=num_tokens,
        num_q_heads=num_q_heads,
    )
    assert tn.prefill_kv_splits == expected
    tn.check_fits(64, 16, jnp.bfloat16)
