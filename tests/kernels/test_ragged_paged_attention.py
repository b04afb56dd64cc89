"""The Mosaic GPU ragged paged attention kernel against the jnp reference (CPU: GPU interpret mode).

Interpret mode costs seconds per call, so the kernel's parameters are covered by a strength-2
covering design (covering.py) instead of their product: for every two parameters of FACTORS, every
pair of values the constraints allow is in some case. The parameters: page size, q heads per kv
head (MQA and MHA among them), kv heads, head dim, dtype, step kind (decode, prefill, mixed), soft
cap, and the tuning's forms (KV block smaller than, equal to and larger than a page, stages,
decode splits, decode warpgroups, ping-pong, producer warps, three compute warpgroups, row sums on
the tensor cores, CTA count, and with fp8 pages Q K^T in fp8 and K converted early; decode items
and prefill tiles interleaved over both compute warpgroups). Every case carries the edge lengths
of its kind: 1, page boundary -1/0/+1, several KV blocks, an empty chunk, padding sequences and
padding tokens.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from covering import pairwise, uncovered_pairs
from kernel_cases import make_step

from pallas_kernels.kv_layout import (
    calibrate_kv_scales,
    dequantize_pages,
    quantize_pages,
    write_kv_reference,
)
from pallas_kernels.ragged_paged_attention import api, schedule
from pallas_kernels.ragged_paged_attention.pallas_attention import (
    bucket_tuning,
    ragged_paged_attention_pallas,
)
from pallas_kernels.ragged_paged_attention.reference import (
    QUERY_DTYPE,
    quantize_query_rows,
    ragged_paged_attention_reference,
)
from pallas_kernels.ragged_paged_attention.tuning import TuningConfig

pytestmark = pytest.mark.timeout(300)  # interpret mode: fail fast rather than hang a CI job

# Max |kernel - reference| over max |reference|, per dtype (bf16: P and O are rounded to bf16).
TOLERANCE = {
    jnp.dtype(jnp.bfloat16): 2e-2,
    jnp.dtype(jnp.float16): 4e-3,
    jnp.dtype(jnp.float32): 2e-5,
}
# fp8 pages: P V rounds P to e4m3 (three mantissa bits), and the kernel's running max moves per KV
# block where the reference's (fp8_probs) moves per page, so their rounding grids differ. With 64 q
# heads per kv head (e4m3 pages, 32-token pages, 64-token blocks, Q K^T in fp8) five seeds gave
# 0.024-0.033, with every interleaved form off as well as on: 0.03 was a seed's luck.
FP8_PAGES_TOLERANCE = 4e-2


def lengths(kind: str, ps: int, group: int) -> tuple[list[int], list[tuple[int, int]]]:
    """Edge lengths of one step kind: KV lengths 1, page boundary -1/0/+1 and several blocks; a
    chunk from position 0 over two KV blocks and two tiles, chunks after a cached prefix, a
    one-token chunk and an empty one. Interpret mode pays per (token, q head) row, so chunk
    lengths do not grow with the page size and shrink with large groups (a tile holds 64 rows:
    with 64 q heads per kv head, one token per warpgroup)."""
    long = 130 if group == 1 else 70 if group <= 8 else 16  # crosses two tiles of any tuning
    mid = 66 if group <= 8 else 8
    decode = [1, ps - 1, ps, ps + 1, 2 * ps + 70]
    prefill = [(long, long), (3, 2 * ps - 1), (0, 0), (mid, mid + ps), (1, ps + 1)]
    if kind == "decode":
        return decode, []
    if kind == "prefill":
        return [], prefill
    return decode[::2], [(long, long), (0, 0), (17, 2 * ps)]


# Each level is a distinct path, not a point on a scale (a case costs 5-15 s of interpret mode on
# CI's two cores): pages smaller than every KV block (16), fp8's smallest page (32), one page a
# block or two blocks a page (64), several blocks a page (256); q heads per kv head: MHA (1), an
# odd group (3), a power of two (8), MQA-like 64 (one token per warpgroup).
FACTORS = {
    "page_size": (16, 32, 64, 256),
    "group": (1, 3, 8, 64),  # q heads per kv head
    "kv_heads": (1, 2, 3),
    "head_dim": (16, 32, 64, 128),
    "dtype": (jnp.bfloat16, jnp.float16, jnp.float32),
    "kind": ("decode", "prefill", "mixed"),
    "soft_cap": (None, 20.0),
    "block_kv": (64, 128),
    "num_stages": (2, 3),
    "decode_splits": (1, 2, 3),
    "decode_wgs": (1, 2),
    "pingpong": (False, True),
    "producer_warps": (1, 4),
    "compute_wgs": (2, 3),
    "mma_row_sums": (False, True),
    "num_ctas": (2, 3),
    "pages": ("same", jnp.float8_e4m3fn, jnp.float8_e5m2),  # the page dtype: q's, or fp8
    # fp8 pages: Q K^T on the 8-bit K stage with Q quantized per row, and K converted under the
    # last block's P V (tuning.py); both compute warpgroups on decode items of >= k blocks.
    "fp8_qk": (False, True),
    "fp8_convert_early": (False, True),
    "decode_interleave": (0, 1, 2),
    # prefill tiles of one Q box, both compute warpgroups on every other block of each; or
    # (per_step) that or one box each, as each call's plan picks (schedule.interleave_pays)
    "prefill_interleave": (False, True, "per_step"),
}
# (parameter, parameter, pair allowed): what the kernel supports, and values that change nothing
# in a step kind (no decode items in a prefill step, no prefill tiles in a decode step).
CONSTRAINTS = [
    ("compute_wgs", "head_dim", lambda wgs, d: wgs == 2 or d <= 64),  # 160 registers each
    ("compute_wgs", "pingpong", lambda wgs, pp: wgs == 2 or not pp),
    ("kind", "decode_splits", lambda kind, k: kind != "prefill" or k == 1),
    ("kind", "decode_wgs", lambda kind, w: kind != "prefill" or w == 1),
    ("kind", "pingpong", lambda kind, pp: kind != "decode" or not pp),
    ("group", "kv_heads", lambda g, h: g < 64 or h == 1),  # 64 q heads per kv head: one is enough
    ("pages", "head_dim", lambda p, d: p == "same" or d >= 32),  # fp8 rows of 16 bytes: no tiling
    ("pages", "page_size", lambda p, ps: p == "same" or ps >= 32),  # the same for V^T's rows
    ("pages", "fp8_qk", lambda p, qk: p != "same" or not qk),  # fp8 page forms only
    ("pages", "fp8_convert_early", lambda p, early: p != "same" or not early),
    # (what those imply through the pages: every allowed pair must also fit in one case)
    ("fp8_qk", "head_dim", lambda qk, d: not qk or d >= 32),
    ("fp8_qk", "page_size", lambda qk, ps: not qk or ps >= 32),
    ("fp8_convert_early", "head_dim", lambda early, d: not early or d >= 32),
    ("fp8_convert_early", "page_size", lambda early, ps: not early or ps >= 32),
    ("compute_wgs", "decode_interleave", lambda wgs, k: wgs == 2 or k == 0),
    ("kind", "decode_interleave", lambda kind, k: kind != "prefill" or k == 0),
    ("compute_wgs", "prefill_interleave", lambda wgs, pil: wgs == 2 or pil is False),
    ("pingpong", "prefill_interleave", lambda pp, pil: not (pp and pil is True)),
    ("kind", "prefill_interleave", lambda kind, pil: kind != "decode" or pil is False),
]


def allowed(case) -> bool:
    return all(ok(case[a], case[b]) for a, b, ok in CONSTRAINTS if a in case and b in case)


CASES = pairwise(FACTORS, allowed)

TUNING_FIELDS = ("block_kv", "num_stages", "decode_splits", "num_ctas", "decode_wgs", "pingpong",
                 "producer_warps", "compute_wgs", "mma_row_sums", "fp8_qk", "fp8_convert_early",
                 "decode_interleave", "prefill_interleave")  # fmt: skip


def _tuning(case) -> TuningConfig:
    return TuningConfig(**{name: case[name] for name in TUNING_FIELDS})


def _case_id(c) -> str:
    tn = _tuning(c)
    flags = [
        f"bk{tn.block_kv}x{tn.num_stages}",
        f"s{tn.decode_splits}",
        f"wg{tn.decode_wgs}",
        "pp" * tn.pingpong,
        f"pw{tn.producer_warps}",
        f"cw{tn.compute_wgs}",
        "mrs" * tn.mma_row_sums,
        "qk" * tn.fp8_qk,
        "early" * tn.fp8_convert_early,
        f"il{tn.decode_interleave}" * bool(tn.decode_interleave),
        {False: "", True: "pil", "per_step": "pils"}[tn.prefill_interleave],
        f"ctas{tn.num_ctas}",
    ]
    pages = "" if c["pages"] == "same" else f"-{jnp.dtype(c['pages']).name}"
    return (
        f"ps{c['page_size']}-g{c['group']}x{c['kv_heads']}-d{c['head_dim']}-"
        f"{jnp.dtype(c['dtype']).name}{pages}-{c['kind']}-cap{c['soft_cap']}-"
        + "-".join(filter(None, flags))
    )


def test_cases_cover_every_allowed_pair():
    assert not uncovered_pairs(CASES, FACTORS, allowed)
    assert len(CASES) < 40  # the point of the design: far fewer cases than the product
    assert {c["pages"] for c in CASES} == set(FACTORS["pages"])


def _rel_err(out, ref) -> float:
    out = np.asarray(out, np.float32)
    ref = np.asarray(ref, np.float32)
    assert np.all(np.isfinite(out))
    return float(np.abs(out - ref).max() / np.abs(ref).max())


def _check(out, ref, dtype, *, fp8_pages: bool = False):
    err = _rel_err(out, ref)
    assert err < max(TOLERANCE[jnp.dtype(dtype)], FP8_PAGES_TOLERANCE * fp8_pages), err


def fp8_pages(step, dtype):
    """The step's arguments with its pages quantized to `dtype` (e4m3 / e5m2), and their scales:
    calibrated on K and V scaled apart (K x 3, V x 0.5), so that k_scale != v_scale != 1."""
    kv = step.kv_pages.astype(jnp.float32) * jnp.asarray([3.0, 0.5])[:, None, None]
    scales = calibrate_kv_scales(kv[:, :, 0], kv[:, :, 1], dtype)
    pages = quantize_pages(kv, scales, dtype)  # V stored transposed (kv_layout.py)
    return (step.q, pages, *step.args[2:]), scales


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_kernel_matches_reference(case):
    ps, d, dtype = case["page_size"], case["head_dim"], case["dtype"]
    dec, pre = lengths(case["kind"], ps, case["group"])
    step = make_step(
        sum(map(ord, _case_id(case))),
        decode_kv_lens=dec,
        prefill=pre,
        page_size=ps,
        num_q_heads=case["group"] * case["kv_heads"],
        num_kv_heads=case["kv_heads"],
        head_dim=d,
        dtype=dtype,
    )
    args, kw = step.args, dict(sm_scale=d**-0.5, soft_cap=case["soft_cap"])
    fp8 = case["pages"] != "same"
    if fp8:
        args, kw["kv_scales"] = fp8_pages(step, case["pages"])
    out = ragged_paged_attention_pallas(*args, **kw, tuning=_tuning(case))
    # With fp8_qk the kernel reads Q quantized per row: the reference on that same Q.
    q8_args = (quantize_query_rows(args[0], QUERY_DTYPE), *args[1:]) if case["fp8_qk"] else args
    ref = ragged_paged_attention_reference(*q8_args, **kw, fp8_probs=fp8)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    _check(out, ref, dtype, fp8_pages=fp8)
    # Padding tokens are exactly zero.
    n = step.num_valid_tokens
    assert np.all(np.asarray(out[n:]) == 0)
    if case["fp8_qk"]:
        # What quantizing Q costs, against the reference on Q as given: more than the kernel's
        # own error above, bounded (e5m2 pages' K has two mantissa bits). e4m3 with 64 q heads
        # per kv head: 0.058-0.113 over five seeds.
        exact = np.asarray(ragged_paged_attention_reference(*args, **kw), np.float32)[:n]
        err = np.abs(np.asarray(out, np.float32)[:n] - exact).max() / np.abs(exact).max()
        assert err < {jnp.float8_e4m3fn: 0.15, jnp.float8_e5m2: 0.2}[case["pages"]], err


# Split prefill tiles (prefill_kv_splits): a long chunk after a cached prefix, a chunk from
# position 32, a one-token chunk and decode rows, on 12 CTAs so that schedule.prefill_parts cuts
# tiles. With one q head per kv head a warpgroup holds 64 tokens, and the chunk at position 32
# puts a part's first key (position 128) inside a warpgroup's rows (96-159): rows 96-127 see no
# key of that part (the -inf row max the kernel must not turn into NaN).
# The third case is a head_dim-64 prefill form on e4m3 pages (Q K^T and P V in fp8), against
# the reference on the same per-row fp8 Q and rounded P.
# (page, q heads, kv heads, dtype, soft cap, pages, tuning)
SPLIT_CASES = [
    (
        *(16, 3, 3, jnp.float32, None, None),
        TuningConfig(64, 2, 1, 12, compute_wgs=3, mma_row_sums=True, prefill_kv_splits=4),
    ),
    (
        *(32, 8, 2, jnp.bfloat16, 20.0, None),
        TuningConfig(64, 2, 1, 12, pingpong=True, prefill_kv_splits=2),
    ),
    (
        *(32, 3, 3, jnp.bfloat16, None, jnp.float8_e4m3fn),
        TuningConfig(
            64,
            2,
            1,
            12,
            compute_wgs=3,
            mma_row_sums=True,
            prefill_kv_splits=4,
            fp8_convert_early=True,
            fp8_qk=True,
        ),
    ),  # fmt: skip
]


@pytest.mark.parametrize(
    "case", SPLIT_CASES, ids=["f32-g1-cw3-k4", "bf16-pingpong-cap-k2", "e4m3-qk-early-cw3-k4"]
)
def test_split_prefill_tiles_match_reference(case):
    ps, hq, hkv, dtype, soft_cap, pages, tuning = case
    step = make_step(
        11,
        decode_kv_lens=[5, 300],
        prefill=[(130, 900), (1, 1), (150, 182)],
        page_size=ps,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=64,
        dtype=dtype,
    )
    tokens_per_tile = tuning.compute_wgs * (64 // (hq // hkv))
    plan = schedule.prefill_parts(
        step.cu_q_lens,
        step.kv_lens,
        step.distribution,
        num_tokens=step.q.shape[0],
        tokens_per_tile=tokens_per_tile,
        block_kv=tuning.block_kv,
        num_kv_heads=hkv,
        num_ctas=tuning.num_ctas,
        max_splits=tuning.prefill_kv_splits,
    )
    assert int(jnp.max(plan.tile_parts)) == tuning.prefill_kv_splits  # tiles were cut
    kw = dict(sm_scale=0.125, soft_cap=soft_cap)
    args, ref_args = step.args, step.args
    if pages is not None:
        args, kw["kv_scales"] = fp8_pages(step, pages)
        ref_args = (quantize_query_rows(args[0], QUERY_DTYPE), *args[1:])
    out = ragged_paged_attention_pallas(*args, **kw, tuning=tuning)
    fp8 = pages is not None
    ref = ragged_paged_attention_reference(*ref_args, **kw, fp8_probs=fp8)
    _check(out, ref, dtype, fp8_pages=fp8)
    assert np.all(np.asarray(out[step.num_valid_tokens :]) == 0)


def mixed_fp8_step(seed, dtype, pages, d, ps, hq, hkv):
    """A mixed step (decode rows, a chunk from position 0, a chunk after a cached prefix) on fp8
    pages: (step, its arguments with the pages quantized, their scales)."""
    step = make_step(
        seed,
        decode_kv_lens=[1, ps + 1, 3 * ps + 5],
        prefill=[(70, 70), (17, 2 * ps + 17)],
        page_size=ps,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        dtype=dtype,
    )
    args, scales = fp8_pages(step, pages)
    return step, args, scales


# fp8 pages whose K is converted (no fp8_qk) off the critical path (tuning.fp8_convert_early: the
# next block's K under this one's P V) give exactly what converting each K block just before its
# Q K^T gives: a mixed step (decode rows, a chunk from position 0, a chunk after a cached prefix)
# with split decode on two decode warpgroups and ping-pong prefill tiles. (The covering design
# has the form against the reference beside the other parameters.)
# (q dtype, pages, head_dim, page size, q heads, kv heads, tuning)
EARLY_CASES = [
    (
        *(jnp.bfloat16, jnp.float8_e4m3fn, 64, 32, 8, 2),
        TuningConfig(64, 2, 2, 3, decode_wgs=2, pingpong=True, fp8_convert_early=True),
    ),
]


@pytest.mark.parametrize("case", EARLY_CASES, ids=["e4m3-split-pingpong"])
def test_fp8_converted_early_matches_reference(case):
    dtype, pages, d, ps, hq, hkv, tuning = case
    step, args, scales = mixed_fp8_step(13, dtype, pages, d, ps, hq, hkv)
    kw = dict(sm_scale=d**-0.5, kv_scales=scales)
    out = ragged_paged_attention_pallas(*args, **kw, tuning=tuning)
    ref = ragged_paged_attention_reference(*args, **kw, fp8_probs=True)
    _check(out, ref, dtype, fp8_pages=True)
    assert np.all(np.asarray(out[step.num_valid_tokens :]) == 0)
    # the same as the form that converts each K block just before its Q K^T
    one_tile = dataclasses.replace(tuning, fp8_convert_early=False)
    np.testing.assert_array_equal(
        np.asarray(out), np.asarray(ragged_paged_attention_pallas(*args, **kw, tuning=one_tile))
    )


# Both compute warpgroups on the decode items of at least tuning.decode_interleave KV blocks: KV
# lengths of one to five blocks (an item of one block leaves the second half none: its row max
# stays -inf for the merge). The covering design has the form beside every other parameter;
# these two add:
# - a decode-only step on three splits, short items alternating owners (decode_wgs=2), every item
#   of a block or more interleaved, three stages: empty and one-block splits let the producer
#   refill a Q slot before the warpgroup that does not own its item had seen it filled, unless
#   that warpgroup also releases the slot (qd_free; interpret mode raised on the missed phase, a
#   GPU could wait for a completion that never comes);
# - the long items only, the short ones alternating owners (hand-overs both ways), on e4m3 pages
#   with Q K^T in fp8.
# (q dtype, pages, head_dim, page size, q heads, kv heads, soft cap, tuning)
INTERLEAVE_CASES = [
    (
        *(jnp.float16, None, 16, 32, 3, 3, 20.0),
        TuningConfig(64, 3, 3, 3, decode_interleave=1, decode_wgs=2),
    ),
    (
        *(jnp.bfloat16, jnp.float8_e4m3fn, 64, 32, 8, 2, None),
        TuningConfig(64, 3, 1, 3, decode_interleave=3, decode_wgs=2, pingpong=True, fp8_qk=True),
    ),
]


@pytest.mark.parametrize("case", INTERLEAVE_CASES, ids=["f16-split3-all-cap", "e4m3-3-qk"])
def test_interleaved_decode_matches_reference(case):
    dtype, pages, d, ps, hq, hkv, cap, tuning = case
    bk = tuning.block_kv
    # Split: a decode-only step with a run of one-token rows (two empty splits each), so that
    # nothing but decode items paces the producer.
    split = tuning.decode_splits > 1
    step = make_step(
        19,
        decode_kv_lens=[1, bk - 1, bk + 1, 2 * bk + 3, 4 * bk + 5] + [1, 2, 3] * 4 * split,
        prefill=[] if split else [(40, 40), (9, bk + 9)],
        page_size=ps,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        dtype=dtype,
    )
    kw = dict(sm_scale=d**-0.5, soft_cap=cap)
    args, ref_args = step.args, step.args
    if pages is not None:
        args, kw["kv_scales"] = fp8_pages(step, pages)
        ref_args = args
        if tuning.fp8_qk:
            ref_args = (quantize_query_rows(args[0], QUERY_DTYPE), *args[1:])
    out = ragged_paged_attention_pallas(*args, **kw, tuning=tuning)
    ref = ragged_paged_attention_reference(*ref_args, **kw, fp8_probs=pages is not None)
    _check(out, ref, dtype, fp8_pages=pages is not None)
    assert np.all(np.asarray(out[step.num_valid_tokens :]) == 0)


# Prefill tiles of one Q box on both compute warpgroups (prefill_interleave): warpgroup 1 starts
# at a tile's second block, so a tile whose first rows sit in its first block has rows that see
# no key of warpgroup 1's first block (a -inf row max that must not become NaN before the merge);
# tiles of one block stay warpgroup 0's. float32 so that the merge is checked to 2e-5, and a
# chunk after a cached prefix beside decode rows of one to several blocks.
def test_interleaved_prefill_matches_reference():
    tuning = TuningConfig(64, 3, 1, 3, prefill_interleave=True, decode_wgs=2)
    tpw, bk = 64 // 3, tuning.block_kv  # three q heads per kv head: 21 tokens a tile
    prefill = [(70, 70), (40, 100), (1, 1)]
    # the chunk from position 0 has a tile over positions 63-83: its first row sees only block 0
    assert any(t < bk <= t + tpw - 1 for t in range(0, 70, tpw))
    step = make_step(
        23,
        decode_kv_lens=[1, bk + 1, 3 * bk + 5],
        prefill=prefill,
        page_size=16,
        num_q_heads=6,
        num_kv_heads=2,
        head_dim=32,
        dtype=jnp.float32,
    )
    kw = dict(sm_scale=32**-0.5, soft_cap=None)
    out = ragged_paged_attention_pallas(*step.args, **kw, tuning=tuning)
    ref = ragged_paged_attention_reference(*step.args, **kw)
    _check(out, ref, jnp.float32)
    assert np.all(np.asarray(out[step.num_valid_tokens :]) == 0)
    plain = ragged_paged_attention_pallas(
        *step.args, **kw, tuning=dataclasses.replace(tuning, prefill_interleave=False)
    )
    np.testing.assert_allclose(np.asarray(out), np.asarray(plain), rtol=0, atol=2e-5)


# The per-step form (prefill_interleave="per_step"): one launch, the tile form read from the plan.
# The existing step above picks paired tiles (with ping-pong) on three CTAs, a step of two
# chunks after a prefix picks interleaved ones (schedule.interleave_pays); both must match the
# reference and the static form the plan chose.
@pytest.mark.parametrize(
    "decode, prefill, interleaved",
    [([1, 65, 197], [(70, 70), (40, 100), (1, 1)], False), ([5], [(100, 700), (60, 600)], True)],
    ids=["paired", "interleaved"],
)
def test_per_step_prefill_matches_reference(decode, prefill, interleaved):
    tuning = TuningConfig(64, 3, 1, 3, prefill_interleave="per_step", decode_wgs=2, pingpong=True)
    hq, hkv = 6, 2
    step = make_step(29, decode_kv_lens=decode, prefill=prefill, page_size=16, num_q_heads=hq,
                     num_kv_heads=hkv, head_dim=32, dtype=jnp.float32)  # fmt: skip
    t = step.q.shape[0]
    kv_lens, cu, dist = schedule.with_padding_sequence(
        step.kv_lens, step.cu_q_lens, step.distribution, num_tokens=t
    )
    plan = schedule.per_step_parts(
        cu, kv_lens, dist, num_tokens=t, tokens_per_wg=64 // 3, block_kv=64, num_kv_heads=hkv,
        num_ctas=3, decode_splits=1,
    )  # fmt: skip
    assert int(plan.meta[schedule.META_INTERLEAVE]) == interleaved
    kw = dict(sm_scale=32**-0.5, soft_cap=None)
    out = ragged_paged_attention_pallas(*step.args, **kw, tuning=tuning)
    ref = ragged_paged_attention_reference(*step.args, **kw)
    _check(out, ref, jnp.float32)
    assert np.all(np.asarray(out[step.num_valid_tokens :]) == 0)
    static = dict(prefill_interleave=True, pingpong=False) if interleaved else {}
    static.setdefault("prefill_interleave", False)
    chosen = ragged_paged_attention_pallas(
        *step.args, **kw, tuning=dataclasses.replace(tuning, **static)
    )
    np.testing.assert_allclose(np.asarray(out), np.asarray(chosen), rtol=0, atol=2e-5)


# fp8 pages' value path (V^T pages, kv_layout.py; the 8-bit V^T stage as P V's operand) checked
# exactly: with Q = 0 every visible key scores 0, P is exactly 2^PROBS_LOG2_SCALE (no rounding), and
# O is the mean of the visible V rows, so any misplaced V column shows. Blocks of two pages (32-
# token pages), a block from one page (64) and blocks sliced out of a page (256), split decode.
# (pages, page size, head_dim, fp8_qk, tuning)
UNIFORM_CASES = [
    (
        jnp.float8_e4m3fn,
        32,
        64,
        TuningConfig(64, 2, 2, 3, decode_wgs=2, pingpong=True, fp8_qk=True),
    ),
    (jnp.float8_e5m2, 64, 128, TuningConfig(64, 3, 1, 2, fp8_convert_early=True)),
    (jnp.float8_e4m3fn, 256, 64, TuningConfig(128, 2, 1, 3, compute_wgs=3, mma_row_sums=True)),
]


@pytest.mark.parametrize("case", UNIFORM_CASES, ids=["e4m3-ps32-split", "e5m2-ps64", "e4m3-ps256"])
def test_fp8_pages_value_path_is_exact_under_uniform_attention(case):
    pages, ps, d, tuning = case
    step, args, scales = mixed_fp8_step(29, jnp.float32, pages, d, ps, 8, 2)
    args = (jnp.zeros_like(args[0]), *args[1:])
    kw = dict(sm_scale=d**-0.5, kv_scales=scales)
    out = ragged_paged_attention_pallas(*args, **kw, tuning=tuning)
    _check(out, ragged_paged_attention_reference(*args, **kw), jnp.float32)
    assert np.all(np.asarray(out[step.num_valid_tokens :]) == 0)


def test_fp8_pages_round_p_as_the_reference_says():
    """P V on fp8 pages rounds P to e4m3 (reference.quantize_probs): where the kernel's KV blocks
    are the reference's pages (64 tokens each) the kernel is several times closer to the
    reference that rounds P than to the one that does not."""
    d = 64
    step, args, scales = mixed_fp8_step(31, jnp.float32, jnp.float8_e5m2, d, 64, 8, 2)
    kw = dict(sm_scale=d**-0.5, kv_scales=scales)
    out = ragged_paged_attention_pallas(*args, **kw, tuning=TuningConfig(64, 2, 1, 3))
    rounded = _rel_err(out, ragged_paged_attention_reference(*args, **kw, fp8_probs=True))
    exact = _rel_err(out, ragged_paged_attention_reference(*args, **kw))
    assert rounded < 4e-3 and rounded * 3 < exact, (rounded, exact)


@pytest.mark.parametrize("pages", [jnp.bfloat16, jnp.float8_e4m3fn])
def test_attention_step_writes_kv_exactly_and_attends(pages):
    """backend="pallas": the written pages equal write_kv_reference bit for bit (fp8 pages:
    quantized with the step's scales), then attention."""
    ps, hq, hkv, d = 32, 4, 2, 64
    step = make_step(
        7,
        decode_kv_lens=[5, 32, 33],
        prefill=[(20, 37)],
        page_size=ps,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        dtype=jnp.bfloat16,
    )
    kv_pages = step.kv_pages.astype(pages)
    scales = jnp.asarray([0.05, 0.02], jnp.float32) if pages != jnp.bfloat16 else None
    t = step.q.shape[0]
    rng = np.random.default_rng(1)
    k = jnp.asarray(rng.standard_normal((t, hkv, d)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((t, hkv, d)), jnp.bfloat16)
    # Slots: each valid token's position in its own pages; padding tokens write to the null page.
    cu, lens, table = (np.asarray(x) for x in (step.cu_q_lens, step.kv_lens, step.page_table))
    slots = np.zeros(t, np.int32)
    for s in range(int(step.distribution[1])):
        for i, tok in enumerate(range(cu[s], cu[s + 1])):
            pos = lens[s] - (cu[s + 1] - cu[s]) + i
            slots[tok] = table[s, pos // ps] * ps + pos % ps
    slots = jnp.asarray(slots)
    kw = dict(sm_scale=d**-0.5, soft_cap=None, kv_scales=scales)
    out, written = api.attention_step(
        step.q,
        k,
        v,
        kv_pages,
        slots,
        step.kv_lens,
        step.page_table,
        step.cu_q_lens,
        step.distribution,
        backend="pallas",
        **kw,
    )
    expected_pages = write_kv_reference(kv_pages, k, v, slots, scales)
    assert written.dtype == pages
    np.testing.assert_array_equal(
        np.asarray(written.astype(jnp.float32)), np.asarray(expected_pages.astype(jnp.float32))
    )
    # the reference backend on the same call: e4m3 pages read Q and P in fp8 on both (the
    # kernel's default schedule, tuning.reads_fp8_query; reference.quantize_probs)
    ref = api.ragged_paged_attention(step.q, expected_pages, *step.args[2:], **kw)
    _check(out, ref, jnp.bfloat16, fp8_pages=pages != jnp.bfloat16)


def test_quantize_query_rows_rounds_each_row_on_its_own_scale():
    q = jnp.asarray([[[0.5, -1.0, 2.0, 0.3]], [[4.0, 0.0, 0.0, 0.0]]], jnp.float32)  # [2, 1, 4]
    got = np.asarray(quantize_query_rows(q, jnp.float8_e4m3fn))
    # row 0: absmax 2, scale 2 / 448 (e4m3's largest): 0.5, -1 and 2 land on 112, -224 and 448,
    # on the grid; 0.3 lands on 67.2, between 64 and 72, and rounds to 64
    np.testing.assert_allclose(got[0, 0], [0.5, -1.0, 2.0, 64 * 2 / 448], rtol=1e-6)
    np.testing.assert_array_equal(got[1, 0], [4.0, 0.0, 0.0, 0.0])  # its own scale, not row 0's


@pytest.mark.parametrize("pages", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_kernel_default_schedule_and_reference_backend_agree_on_fp8_pages(pages):
    """The engine's two backends compute one function with fp8 pages in a decode bucket: the
    kernel on its default schedule (Q K^T in fp8 with an e4m3 Q on both page dtypes) and the
    reference path (Q rows and P rounded to e4m3). Within FP8_PAGES_TOLERANCE: split
    decode and the kernel's block-wise running max round P on other grids than the reference's
    page-wise one (test_fp8_pages_round_p_as_the_reference_says compares them on one grid)."""
    d = 64
    step, args, scales = mixed_fp8_step(23, jnp.float16, pages, d, 32, 8, 2)
    tuning = bucket_tuning(args[0], args[1], args[3], interpret=True)
    assert tuning.fp8_qk and tuning.fp8_convert_early
    kw = dict(sm_scale=d**-0.5, kv_scales=scales)
    out = api.ragged_paged_attention(*args, **kw, backend="pallas")
    ref = api.ragged_paged_attention(*args, **kw, backend="reference")
    _check(out, ref, jnp.float16, fp8_pages=True)


@pytest.mark.parametrize("num_tokens", [64, 2048], ids=["decode-bucket", "prefill-bucket"])
@pytest.mark.parametrize("pages", [jnp.bfloat16, jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_reference_backend_reads_q_in_fp8_where_the_kernel_schedule_does(num_tokens, pages):
    """fp8 pages (e4m3 and e5m2), in a decode bucket and in a prefill bucket (2,048 tokens and
    more): the engine's reference path quantizes Q per row to e4m3, as the kernel's default
    schedule does (fp8_qk), and rounds P to e4m3, as the kernel always does
    (reference.quantize_probs); with bf16 pages it reads Q as given."""
    d = 32
    step = make_step(
        5, decode_kv_lens=[3, 40], prefill=[(9, 30)], page_size=16, num_q_heads=4,
        num_kv_heads=2, head_dim=d, dtype=jnp.bfloat16, extra_tokens=num_tokens - 11,
    )  # fmt: skip
    assert step.q.shape[0] == num_tokens
    n = step.num_valid_tokens
    if pages == jnp.bfloat16:
        kw = dict(sm_scale=d**-0.5)
        out = np.asarray(api.ragged_paged_attention(*step.args, **kw, backend="reference"))[:n]
        as_given = np.asarray(ragged_paged_attention_reference(*step.args, **kw))[:n]
        np.testing.assert_array_equal(out, as_given)
        return
    args, scales = fp8_pages(step, pages)
    kw = dict(sm_scale=d**-0.5, kv_scales=scales)
    out = np.asarray(api.ragged_paged_attention(*args, **kw, backend="reference"))[:n]
    q8 = quantize_query_rows(args[0], QUERY_DTYPE)
    both = np.asarray(ragged_paged_attention_reference(q8, *args[1:], **kw, fp8_probs=True))[:n]
    np.testing.assert_array_equal(out, both)
    # each rounding shows, so the check above bites on both
    exact_p = np.asarray(ragged_paged_attention_reference(q8, *args[1:], **kw))[:n]
    exact_q = np.asarray(ragged_paged_attention_reference(*args, **kw, fp8_probs=True))[:n]
    assert not np.array_equal(exact_p, both) and not np.array_equal(exact_q, both)


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_reference_reads_fp8_pages_as_their_dequantized_values(dtype):
    """The reference on fp8 pages and scales equals a float32 computation on the dequantized
    values (float32 pages, no scales): the kernel cases above compare against it."""
    step = make_step(
        2,
        decode_kv_lens=[1, 33, 64],
        prefill=[(20, 50), (5, 5)],
        page_size=16,
        num_q_heads=6,
        num_kv_heads=2,
        head_dim=32,
        dtype=jnp.float32,
    )
    args, scales = fp8_pages(step, dtype)
    deq = dequantize_pages(args[1], scales)
    kw = dict(sm_scale=0.2, soft_cap=None)
    got = ragged_paged_attention_reference(*args, **kw, kv_scales=scales)
    want = ragged_paged_attention_reference(step.q, deq, *step.args[2:], **kw)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    assert float(jnp.abs(want - ragged_paged_attention_reference(*step.args, **kw)).max()) > 1e-3


def test_empty_step_is_all_zero():
    step = make_step(
        3,
        decode_kv_lens=[],
        prefill=[],
        page_size=16,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=32,
        dtype=jnp.bfloat16,
        extra_seqs=2,
        extra_tokens=16,
    )
    out = ragged_paged_attention_pallas(*step.args, sm_scale=0.2, tuning=TuningConfig(64, 2, 1, 2))
    assert np.all(np.asarray(out) == 0)


def _bad(**changes):
    step = make_step(
        0,
        decode_kv_lens=[3],
        prefill=[],
        page_size=16,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=64,
        dtype=jnp.bfloat16,
    )
    args = dict(
        q=step.q,
        kv_pages=step.kv_pages,
        kv_lens=step.kv_lens,
        page_table=step.page_table,
        cu_q_lens=step.cu_q_lens,
        distribution=step.distribution,
    )
    kw = dict(sm_scale=0.125, soft_cap=None)
    for name, value in changes.items():
        (args if name in args else kw)[name] = value
    return args, kw


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(q=jnp.zeros((4, 4, 48), jnp.bfloat16)), "head_dim"),
        (dict(q=jnp.zeros((4, 4, 64), jnp.float16)), "dtype"),
        (dict(q=jnp.zeros((4, 3, 64), jnp.bfloat16)), "multiple"),
        (dict(q=jnp.zeros((4, 2 * 65, 64), jnp.bfloat16)), "group"),
        (dict(kv_pages=jnp.zeros((4, 2, 2, 24, 64), jnp.bfloat16)), "page_size"),
        (dict(kv_lens=jnp.zeros((2,), jnp.float32)), "kv_lens"),
        (dict(page_table=jnp.zeros((5, 2), jnp.int32)), "page_table"),
        (dict(cu_q_lens=jnp.zeros((7,), jnp.int32)), "cu_q_lens"),
        (dict(distribution=jnp.zeros((3,), jnp.int32)), "distribution"),
        (dict(sm_scale=0.0), "sm_scale"),
        (dict(soft_cap=-1.0), "soft_cap"),
        (dict(kv_scales=jnp.ones(2, jnp.float32)), "fp8 pages only"),
        (
            dict(
                q=jnp.zeros((4, 4, 16), jnp.bfloat16),
                kv_pages=jnp.zeros((4, 2, 2, 16, 16), jnp.float8_e4m3fn),
            ),
            "head_dim=16 must be one of",
        ),
        (
            dict(kv_pages=jnp.zeros((4, 2, 2, 16, 64), jnp.float8_e5m2), kv_scales=jnp.ones(3)),
            "kv_scales.shape",
        ),
        (
            dict(kv_pages=jnp.zeros((4, 2, 2, 16, 64), jnp.float8_e4m3fn)),
            "page_size=16 must be >= 32",
        ),
    ],
)
def test_bad_inputs_raise_value_error(changes, match):
    args, kw = _bad(**changes)
    with pytest.raises(ValueError, match=match):
        ragged_paged_attention_pallas(**args, **kw)


def test_bad_backend_and_tuning_raise_value_error():
    args, kw = _bad()
    with pytest.raises(ValueError, match="backend"):
        api.ragged_paged_attention(**args, **kw, backend="triton")
    with pytest.raises(ValueError, match="block_kv"):
        TuningConfig(block_kv=96)
    with pytest.raises(ValueError, match="num_stages"):
        TuningConfig(num_stages=1)
    with pytest.raises(ValueError, match="SMEM"):
        TuningConfig(block_kv=256, num_stages=8).check_fits(128, 16, jnp.bfloat16)
    with pytest.raises(ValueError, match="decode_wgs=3"):
        TuningConfig(decode_wgs=3)
    with pytest.raises(ValueError, match="pingpong='yes'"):
        TuningConfig(pingpong="yes")
    with pytest.raises(ValueError, match="producer_warps=2"):
        TuningConfig(producer_warps=2)
    with pytest.raises(ValueError, match="producer_warps=True"):  # a bool is not a count
        TuningConfig(producer_warps=True)
    with pytest.raises(ValueError, match="decode_wgs=True"):
        TuningConfig(decode_wgs=True)
    with pytest.raises(ValueError, match="compute_wgs=4"):
        TuningConfig(compute_wgs=4)
    with pytest.raises(ValueError, match="compute_wgs=True"):
        TuningConfig(compute_wgs=True)
    with pytest.raises(ValueError, match="mma_row_sums=1"):  # picks a kernel form: a bool
        TuningConfig(mma_row_sums=1)
    with pytest.raises(ValueError, match="prefill_interleave=1"):
        TuningConfig(prefill_interleave=1)
    with pytest.raises(ValueError, match="pingpong=True"):  # the two compute different blocks
        TuningConfig(pingpong=True, prefill_interleave=True)
    with pytest.raises(ValueError, match="compute_wgs=3"):
        TuningConfig(compute_wgs=3, prefill_interleave=True)
    with pytest.raises(ValueError, match="prefill_kv_splits=2"):
        TuningConfig(prefill_kv_splits=2, prefill_interleave=True)
    with pytest.raises(ValueError, match="prefill_interleave='auto'"):  # per_step is the word
        TuningConfig(prefill_interleave="auto")
    with pytest.raises(ValueError, match="per_step.*compute_wgs=3"):  # pairs need two
        TuningConfig(compute_wgs=3, prefill_interleave="per_step")
    with pytest.raises(ValueError, match="per_step.*prefill_kv_splits=4"):
        TuningConfig(prefill_kv_splits=4, prefill_interleave="per_step")
    # its paired tiles take turns: ping-pong is allowed
    assert TuningConfig(pingpong=True, prefill_interleave="per_step").prefill_boxes == 2
    with pytest.raises(ValueError, match="decode_interleave=True"):  # a block count, not a bool
        TuningConfig(decode_interleave=True)
    with pytest.raises(ValueError, match="decode_interleave=-1"):
        TuningConfig(decode_interleave=-1)
    with pytest.raises(ValueError, match="compute_wgs=3"):  # two warpgroups split an item
        TuningConfig(128, 2, 1, compute_wgs=3, decode_interleave=4)
    with pytest.raises(ValueError, match="SMEM"):  # the hand-over's staging counts
        TuningConfig(128, 2, 1, decode_interleave=1).check_fits(128, 16, jnp.bfloat16)
    with pytest.raises(ValueError, match="SMEM"):  # the ones tiles count
        TuningConfig(128, 2, 1, decode_wgs=2, mma_row_sums=True).check_fits(128, 16, jnp.bfloat16)
    with pytest.raises(ValueError, match="prefill_kv_splits=0"):
        TuningConfig(prefill_kv_splits=0)
    with pytest.raises(ValueError, match="prefill_kv_splits=True"):
        TuningConfig(prefill_kv_splits=True)
    with pytest.raises(ValueError, match="prefill_kv_splits=9"):
        TuningConfig(prefill_kv_splits=9)
    with pytest.raises(ValueError, match="fp8_convert_early"):
        TuningConfig(fp8_convert_early=1)
    with pytest.raises(ValueError, match="fp8_qk"):
        TuningConfig(fp8_qk=1)
    # fp8_qk: an 8-bit Q tile per compute warpgroup, and no K tile (early conversion keeps one)
    base, qk = TuningConfig(128, 2, fp8_convert_early=True), TuningConfig(128, 2, fp8_qk=True)
    qk_early = dataclasses.replace(qk, fp8_convert_early=True)
    fp8 = dict(kv_dtype=jnp.float8_e4m3fn)
    assert qk.smem_bytes(64, jnp.bfloat16, **fp8) == qk_early.smem_bytes(64, jnp.bfloat16, **fp8)
    assert base.smem_bytes(64, jnp.bfloat16, **fp8) - qk.smem_bytes(64, jnp.bfloat16, **fp8) == (
        2 * 128 * 64 * 2 - 2 * 64 * 64
    )
    assert qk.smem_bytes(64, jnp.bfloat16) == TuningConfig(128, 2).smem_bytes(64, jnp.bfloat16)
    # fp8 pages: an e4m3 P tile per compute warpgroup (64 x block_kv bytes); converting K early
    # needs no second tile (V is never converted)
    late, early = (
        TuningConfig(128, compute_wgs=3),
        TuningConfig(128, compute_wgs=3, fp8_convert_early=True),
    )
    assert early.smem_bytes(64, jnp.bfloat16, **fp8) == late.smem_bytes(64, jnp.bfloat16, **fp8)
    k_tiles, p_tiles, half_stages = 3 * 128 * 64 * 2, 3 * 64 * 128, 2 * 2 * 128 * 64
    assert late.smem_bytes(64, jnp.bfloat16) - late.smem_bytes(64, jnp.bfloat16, **fp8) == (
        half_stages - k_tiles - p_tiles
    )
    with pytest.raises(ValueError, match="block_kv=256 must be <= 128 with fp8 pages"):
        TuningConfig(256, 2).check_fits(64, 256, jnp.bfloat16, kv_dtype=jnp.float8_e5m2)
    with pytest.raises(ValueError, match="pingpong=True needs compute_wgs=2"):
        TuningConfig(compute_wgs=3, pingpong=True)
    with pytest.raises(ValueError, match="head_dim=128"):  # 160 registers: no head_dim-128 tile
        TuningConfig(compute_wgs=3).check_fits(128, 16, jnp.bfloat16)
    with pytest.raises(ValueError, match="block_kv=256"):
        TuningConfig(256, 2, compute_wgs=3).check_fits(64, 16, jnp.bfloat16)
    TuningConfig(128, 3, compute_wgs=3).check_fits(64, 16, jnp.bfloat16)
    with pytest.raises(ValueError, match="SMEM"):  # per-warpgroup split staging counts
        TuningConfig(64, 3, 2, decode_wgs=2).check_fits(128, 16, jnp.bfloat16)
    TuningConfig(64, 3, 2, decode_wgs=1).check_fits(128, 16, jnp.bfloat16)


def test_gpu_only_dtype_rule():
    """float32 runs in interpret mode; a compiled (GPU) launch refuses it before lowering."""
    args, kw = _bad(
        q=jnp.zeros((4, 4, 64), jnp.float32), kv_pages=jnp.zeros((4, 2, 2, 16, 64), jnp.float32)
    )
    with pytest.raises(ValueError, match="dtype"):
        ragged_paged_attention_pallas(**args, **kw, interpret=False)
    assert jax.default_backend() == "cpu"
