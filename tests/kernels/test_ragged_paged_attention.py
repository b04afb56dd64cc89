"""The Mosaic GPU ragged paged attention kernel against the jnp reference (CPU: GPU interpret mode).

Interpret mode is slow (seconds per call), so the product of page size {16, 32, 64, 128, 256} x
q heads per kv head {1, 3, 4, 8, 64; MQA among them} x head dim {64, 128} x dtype {bf16, f32} x
step kind {decode, prefill, mixed} is covered pairwise for every pair that involves the step kind,
the dtype or the group (page size x group only partly). The cases also vary the soft cap, the KV
block (smaller than, equal to and larger than a page) and the decode splits, and every case carries
the edge lengths: 1, page boundary -1/0/+1, several KV blocks, an empty chunk, padding sequences and
padding tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_cases import make_step

from pallas_kernels.kv_layout import write_kv_reference
from pallas_kernels.ragged_paged_attention import api, schedule
from pallas_kernels.ragged_paged_attention.pallas_attention import ragged_paged_attention_pallas
from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention_reference
from pallas_kernels.ragged_paged_attention.tuning import TuningConfig

pytestmark = pytest.mark.timeout(300)  # interpret mode: fail fast rather than hang a CI job

# Max |kernel - reference| over max |reference|, per dtype (bf16: P and O are rounded to bf16).
TOLERANCE = {jnp.dtype(jnp.bfloat16): 2e-2, jnp.dtype(jnp.float32): 2e-5}


def lengths(kind: str, ps: int) -> tuple[list[int], list[tuple[int, int]]]:
    """Edge lengths of one step kind: 1, page boundary -1/0/+1, several blocks, an empty chunk."""
    decode = [1, ps - 1, ps, ps + 1, 2 * ps + 70]
    prefill = [(ps + 1, ps + 1), (3, 2 * ps - 1), (0, 0), (70, 70 + ps)]
    if kind == "decode":
        return decode, []
    if kind == "prefill":
        return [], prefill
    return decode[::2], prefill[::2] + [(ps - 1, 2 * ps)]


# (page_size, q heads, kv heads, head_dim, dtype, kind, soft_cap, tuning)
CASES = [
    (16, 8, 2, 64, jnp.bfloat16, "mixed", None, TuningConfig(64, 2, 1, 3)),
    (16, 3, 1, 128, jnp.float32, "prefill", 20.0, TuningConfig(64, 3, 1, 2)),
    (32, 4, 1, 128, jnp.float32, "decode", None, TuningConfig(64, 2, 3, 3)),
    (32, 2, 2, 64, jnp.bfloat16, "prefill", None, TuningConfig(128, 2, 1, 3)),
    (64, 16, 2, 64, jnp.bfloat16, "decode", 20.0, TuningConfig(64, 2, 2, 2)),
    (64, 4, 4, 128, jnp.float32, "mixed", None, TuningConfig(64, 2, 1, 3)),
    (256, 8, 1, 64, jnp.float32, "mixed", None, TuningConfig(64, 2, 1, 3)),
    (256, 9, 3, 128, jnp.bfloat16, "prefill", None, TuningConfig(128, 2, 1, 2)),
    (128, 6, 2, 64, jnp.bfloat16, "decode", None, TuningConfig(128, 2, 1, 3)),
    (16, 4, 4, 128, jnp.bfloat16, "decode", None, TuningConfig(64, 3, 2, 3)),
    (32, 3, 1, 64, jnp.bfloat16, "mixed", 20.0, TuningConfig(64, 2, 1, 2)),
    (64, 8, 2, 128, jnp.bfloat16, "prefill", None, TuningConfig(128, 2, 1, 3)),
    (256, 2, 2, 64, jnp.float32, "decode", None, TuningConfig(128, 2, 2, 3)),
    (32, 8, 1, 64, jnp.bfloat16, "prefill", None, TuningConfig(64, 2, 1, 3)),
    (16, 64, 1, 32, jnp.bfloat16, "mixed", None, TuningConfig(64, 2, 2, 3)),  # one token per tile
    # decode_wgs=2: decode items alternate between the compute warpgroups; splits 1 (output staged
    # in the Q slot) and 3 (each warpgroup's own f32 staging), and a mixed step, where prefill
    # tiles share the Q slots with decode items.
    (16, 8, 2, 64, jnp.bfloat16, "decode", None, TuningConfig(64, 2, 1, 3, decode_wgs=2)),
    (32, 4, 1, 128, jnp.bfloat16, "decode", None, TuningConfig(64, 2, 3, 2, decode_wgs=2)),
    (16, 6, 2, 64, jnp.bfloat16, "mixed", None, TuningConfig(64, 3, 2, 3, decode_wgs=2)),
    # pingpong: prefill tiles' warpgroups take turns on a rendezvous barrier; a tile whose second
    # warpgroup has no tokens, causal blocks one computes and the other skips, decode items (which
    # never take turns) in the same step, and a soft cap.
    (16, 8, 2, 64, jnp.bfloat16, "prefill", None, TuningConfig(64, 2, 1, 3, pingpong=True)),
    (32, 4, 1, 128, jnp.float32, "mixed", 20.0, TuningConfig(64, 3, 2, 2, pingpong=True)),
    (64, 9, 3, 64, jnp.bfloat16, "mixed", None, TuningConfig(128, 2, 1, 3, 2, pingpong=True)),
    # producer_warps=4: the producer's warps share the copies; two page lanes (8 pages a block,
    # decode items in the step), one lane (a block is one page), and blocks inside a page.
    (16, 8, 2, 64, jnp.bfloat16, "mixed", None, TuningConfig(128, 2, 1, 3, producer_warps=4)),
    (64, 4, 1, 128, jnp.float32, "prefill", None, TuningConfig(64, 3, 1, 2, producer_warps=4)),
    (256, 6, 2, 64, jnp.bfloat16, "decode", None, TuningConfig(128, 2, 2, 3, producer_warps=4)),
    # compute_wgs=3: 192-row prefill tiles (a tile whose third warpgroup has no tokens, causal
    # blocks two compute and one skips), decode items (split or whole) on warpgroup 0 or on
    # warpgroups 0 and 1 (warpgroup 2 only releases their stages), four producer warps, soft cap.
    (16, 8, 2, 64, jnp.bfloat16, "mixed", None, TuningConfig(64, 2, 2, 3, compute_wgs=3)),
    (32, 4, 1, 64, jnp.float32, "prefill", 20.0, TuningConfig(64, 3, 1, 2, compute_wgs=3)),
    (
        *(16, 9, 3, 64, jnp.bfloat16, "mixed", None),
        TuningConfig(128, 2, 1, 3, compute_wgs=3, decode_wgs=2, producer_warps=4),
    ),
    (64, 9, 3, 64, jnp.bfloat16, "decode", None, TuningConfig(128, 2, 3, 3, compute_wgs=3)),
    # mma_row_sums: softmax denominators from P @ ones on the tensor cores; the head_dim-64
    # prefill default (three warpgroups, causal blocks one warpgroup skips, whole decode on two
    # warpgroups in the same step), split decode (empty splits' sums are 0), ping-pong with a
    # soft cap, float32 (tf32 sums) and block_kv 64.
    (
        *(16, 9, 3, 64, jnp.bfloat16, "mixed", None),
        TuningConfig(
            128, 2, 1, 3, compute_wgs=3, decode_wgs=2, producer_warps=4, mma_row_sums=True
        ),
    ),
    (32, 8, 2, 64, jnp.bfloat16, "decode", None, TuningConfig(64, 2, 3, 3, mma_row_sums=True)),
    (
        *(16, 4, 1, 128, jnp.bfloat16, "mixed", 20.0),
        TuningConfig(64, 2, 1, 2, pingpong=True, mma_row_sums=True),
    ),
    (64, 4, 2, 64, jnp.float32, "prefill", None, TuningConfig(64, 3, 1, 3, mma_row_sums=True)),
]


def _case_id(c) -> str:
    ps, hq, hkv, d, dt, kind, cap, tn = c
    name = f"ps{ps}-g{hq // hkv}x{hkv}-d{d}-{jnp.dtype(dt).name}-{kind}-cap{cap}"
    pp = "-pingpong" if tn.pingpong else ""
    pw = f"-pw{tn.producer_warps}" * (tn.producer_warps > 1)
    cw = f"-cw{tn.compute_wgs}" * (tn.compute_wgs != 2)
    rs = "-mma-row-sums" * tn.mma_row_sums
    return f"{name}-bk{tn.block_kv}s{tn.decode_splits}wg{tn.decode_wgs}{pp}{pw}{cw}{rs}"


def _check(out, ref, dtype):
    out = np.asarray(out, np.float32)
    ref = np.asarray(ref, np.float32)
    assert np.all(np.isfinite(out))
    err = np.abs(out - ref).max() / np.abs(ref).max()
    assert err < TOLERANCE[jnp.dtype(dtype)], err


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_kernel_matches_reference(case):
    ps, hq, hkv, d, dtype, kind, soft_cap, tuning = case
    dec, pre = lengths(kind, ps)
    step = make_step(
        sum(map(ord, _case_id(case))),
        decode_kv_lens=dec,
        prefill=pre,
        page_size=ps,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        dtype=dtype,
    )
    kw = dict(sm_scale=d**-0.5, soft_cap=soft_cap)
    out = ragged_paged_attention_pallas(*step.args, **kw, tuning=tuning)
    ref = ragged_paged_attention_reference(*step.args, **kw)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    _check(out, ref, dtype)
    # Padding tokens are exactly zero.
    assert np.all(np.asarray(out[step.num_valid_tokens :]) == 0)


# Split prefill tiles (prefill_kv_splits): a long chunk after a cached prefix, a chunk from
# position 32, a one-token chunk and decode rows, on 12 CTAs so that schedule.prefill_parts cuts
# tiles. With one q head per kv head a warpgroup holds 64 tokens, and the chunk at position 32
# puts a part's first key (position 128) inside a warpgroup's rows (96-159): rows 96-127 see no
# key of that part (the -inf row max the kernel must not turn into NaN).
# (page, q heads, kv heads, dtype, soft cap, tuning)
SPLIT_CASES = [
    (
        *(16, 3, 3, jnp.float32, None),
        TuningConfig(64, 2, 1, 12, compute_wgs=3, mma_row_sums=True, prefill_kv_splits=4),
    ),
    (32, 8, 2, jnp.bfloat16, 20.0, TuningConfig(64, 2, 1, 12, pingpong=True, prefill_kv_splits=2)),
]


@pytest.mark.parametrize("case", SPLIT_CASES, ids=["f32-g1-cw3-k4", "bf16-pingpong-cap-k2"])
def test_split_prefill_tiles_match_reference(case):
    ps, hq, hkv, dtype, soft_cap, tuning = case
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
    out = ragged_paged_attention_pallas(*step.args, **kw, tuning=tuning)
    ref = ragged_paged_attention_reference(*step.args, **kw)
    _check(out, ref, dtype)
    assert np.all(np.asarray(out[step.num_valid_tokens :]) == 0)


def test_attention_step_writes_kv_exactly_and_attends():
    """backend="pallas": the written pages equal write_kv_reference bit for bit, then attention."""
    ps, hq, hkv, d = 16, 4, 2, 64
    step = make_step(
        7,
        decode_kv_lens=[5, 16, 17],
        prefill=[(20, 37)],
        page_size=ps,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        dtype=jnp.bfloat16,
    )
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
    kw = dict(sm_scale=d**-0.5, soft_cap=None)
    out, pages = api.attention_step(
        step.q,
        k,
        v,
        step.kv_pages,
        slots,
        step.kv_lens,
        step.page_table,
        step.cu_q_lens,
        step.distribution,
        backend="pallas",
        **kw,
    )
    expected_pages = write_kv_reference(step.kv_pages, k, v, slots)
    np.testing.assert_array_equal(np.asarray(pages), np.asarray(expected_pages))
    ref = ragged_paged_attention_reference(step.q, expected_pages, *step.args[2:], **kw)
    _check(out, ref, jnp.bfloat16)


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
    with pytest.raises(ValueError, match="SMEM"):  # the ones tiles count
        TuningConfig(128, 2, 1, decode_wgs=2, mma_row_sums=True).check_fits(128, 16, jnp.bfloat16)
    with pytest.raises(ValueError, match="prefill_kv_splits=0"):
        TuningConfig(prefill_kv_splits=0)
    with pytest.raises(ValueError, match="prefill_kv_splits=True"):
        TuningConfig(prefill_kv_splits=True)
    with pytest.raises(ValueError, match="prefill_kv_splits=9"):
        TuningConfig(prefill_kv_splits=9)
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
