"""default_tuning through its effect: every bucket the kernel supports gets a configuration that is
valid and fits a Hopper CTA (shared memory, registers, pages tiling into KV blocks), and every row
of the tuning table (tuning.RULES) takes effect in the bucket its evidence measured."""

from __future__ import annotations

import dataclasses
import itertools

import jax.numpy as jnp
import pytest

from pallas_kernels.ragged_paged_attention.pallas_attention import (
    FP8_HEAD_DIMS,
    GPU_DTYPES,
    SUPPORTED_HEAD_DIMS,
)
from pallas_kernels.ragged_paged_attention.tuning import RULES, TuningConfig, default_tuning

SUPPORTED_BUCKETS = itertools.product(
    SUPPORTED_HEAD_DIMS,
    (8, 16, 32, 64, 128, 256),  # page sizes
    (1, 32, 256, 1024),  # sequences
    (1, 3, 8),  # kv heads
    (1, 3, 8, 64),  # q heads per kv head
    (16, 256, 2048, 8192),  # token buckets: decode-heavy to prefill-heavy
    (512, 8192),  # longest context
    GPU_DTYPES,
    (None, jnp.float8_e4m3fn, jnp.float8_e5m2),  # pages: q's dtype, or fp8
)


def test_every_supported_bucket_gets_a_configuration_that_fits():
    picked = set()
    for hd, ps, seqs, hkv, group, tokens, ctx, dtype, kv_dtype in SUPPORTED_BUCKETS:
        if kv_dtype is not None and hd not in FP8_HEAD_DIMS:
            continue
        tn = default_tuning(
            num_seqs=seqs,
            num_kv_heads=hkv,
            head_dim=hd,
            page_size=ps,
            pages_per_seq=ctx // ps,
            dtype=dtype,
            num_tokens=tokens,
            num_q_heads=hkv * group,
            kv_dtype=kv_dtype,
        )
        assert isinstance(tn, TuningConfig)  # validated in __post_init__
        # ValueError: SMEM (with fp8 pages, the P tiles and any dequantized K tile too),
        # registers, page tiling.
        tn.check_fits(hd, ps, dtype, kv_dtype=kv_dtype)
        picked.add(tn)
    assert len(picked) > 10  # the grid reaches many forms, not one fallback


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.when)
def test_each_rule_takes_effect_where_it_was_measured(rule):
    tn = default_tuning(**rule.measured, dtype=jnp.bfloat16)
    got = {name: getattr(tn, name) for name in rule.fields}
    assert got == rule.fields, rule.evidence
    kv_dtype = rule.measured.get("kv_dtype")
    tn.check_fits(
        rule.measured["head_dim"], rule.measured["page_size"], jnp.bfloat16, kv_dtype=kv_dtype
    )


@pytest.mark.parametrize(
    "head_dim, block_kv, stages", [(64, 128, 6), (128, 64, 6)], ids=["hd64", "hd128"]
)
def test_fp8_decode_buckets_take_their_own_blocks_and_prefill_buckets_bf16s(
    head_dim, block_kv, stages
):
    shape = dict(num_seqs=1024, num_kv_heads=8, head_dim=head_dim, page_size=16)
    shape.update(pages_per_seq=64, dtype=jnp.bfloat16, num_q_heads=32)
    fp8 = default_tuning(**shape, num_tokens=1024, kv_dtype=jnp.float8_e4m3fn)
    assert (fp8.block_kv, fp8.num_stages) == (block_kv, stages)
    assert fp8.fp8_convert_early and fp8.fp8_qk
    # e5m2 pages run the same schedule: Q K^T in fp8 with an e4m3 Q (reference.QUERY_DTYPE)
    assert default_tuning(**shape, num_tokens=1024, kv_dtype=jnp.float8_e5m2) == fp8
    bf16 = default_tuning(**shape, num_tokens=1024)
    assert not (bf16.fp8_convert_early or bf16.fp8_qk)
    assert (bf16.block_kv, bf16.num_stages) != (block_kv, stages)
    # a prefill bucket with fp8 pages keeps bf16's blocks and reads Q in fp8 there too
    prefill = dict(shape, num_seqs=8, num_tokens=8192)
    bf16_prefill = default_tuning(**prefill)
    for kv_dtype in (jnp.float8_e4m3fn, jnp.float8_e5m2):
        fp8_prefill = default_tuning(**prefill, kv_dtype=kv_dtype)
        # (the 8-bit stages leave room for split-decode staging that bf16's may not, and a
        # prefill bucket tries its splits first: _candidates)
        fields = ("decode_splits", "decode_wgs", "producer_warps")
        splits = {name: getattr(fp8_prefill, name) for name in fields}
        assert fp8_prefill == dataclasses.replace(bf16_prefill, fp8_qk=True, **splits)
        fp8_prefill.check_fits(head_dim, 16, jnp.bfloat16, kv_dtype=kv_dtype)


def test_rules_set_only_tuning_fields():
    names = {f.name for f in dataclasses.fields(TuningConfig)}
    for rule in RULES:
        assert set(rule.fields) <= names and rule.evidence, rule.when


def test_prefill_interleave_only_where_one_box_tiles_fit_one_round():
    """The 135M layout's 512-token bucket interleaves its prefill tiles and keeps its KV blocks
    (the staging fits beside them); where one-box tiles would need a second round of CTAs (1,024
    tokens, or 32 q heads at 512), fp8 pages (not measured) and prefill buckets do not."""
    shape = dict(num_seqs=256, head_dim=64, page_size=64, pages_per_seq=128, dtype=jnp.bfloat16)
    short = default_tuning(**shape, num_kv_heads=3, num_q_heads=9, num_tokens=512)
    assert short.prefill_interleave and not short.pingpong
    plain = dataclasses.replace(short, prefill_interleave=False, pingpong=True)
    assert (short.block_kv, short.num_stages, short.decode_wgs) == (128, 3, 2)
    assert plain.smem_bytes(64, jnp.bfloat16) < short.smem_bytes(64, jnp.bfloat16)
    for changes in (
        dict(num_kv_heads=3, num_q_heads=9, num_tokens=1024),
        dict(num_kv_heads=8, num_q_heads=32, num_tokens=512),
        dict(num_kv_heads=3, num_q_heads=9, num_tokens=512, kv_dtype=jnp.float8_e4m3fn),
        dict(num_kv_heads=3, num_q_heads=9, num_tokens=2048),
    ):
        assert not default_tuning(**shape, **changes).prefill_interleave, changes
