"""The kernel's work-item schedule: right tiles and parts, the merge of split tiles, and no while
loop in the step's metadata math.

A while loop in a GPU program waits for the host at every iteration (it reads the predicate back);
computed once per layer, the schedule's former `jnp.searchsorted` loop made the engine's step
host-bound. These tests keep the metadata loop-free.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.ragged_paged_attention import schedule
from pallas_kernels.ragged_paged_attention.mgpu_items import snake_count, snake_item
from pallas_kernels.ragged_paged_attention.partial_merge import merge_prefill_parts
from pallas_kernels.ragged_paged_attention.reference import token_metadata


def _tiles_numpy(q_lens, num_decode, tokens_per_tile):
    seqs, toks = [], []
    start = 0
    for s, n in enumerate(q_lens):
        if s >= num_decode:
            for t in range(0, n, tokens_per_tile):
                seqs.append(s)
                toks.append(start + t)
        start += n
    return seqs, toks


@pytest.mark.parametrize("seed", range(4))
def test_prefill_tiles_match_a_plain_loop(seed):
    rng = np.random.default_rng(seed)
    max_seqs, tpt = 12, 8
    num_seqs = int(rng.integers(1, max_seqs + 1))
    num_decode = int(rng.integers(0, num_seqs + 1))
    q_lens = [1] * num_decode + [int(x) for x in rng.integers(1, 40, num_seqs - num_decode)]
    cu = np.zeros(max_seqs + 1, np.int32)
    cu[1 : num_seqs + 1] = np.cumsum(q_lens)
    cu[num_seqs + 1 :] = cu[num_seqs]
    num_tokens = int(cu[-1]) + 5  # a padded bucket
    tile_seq, tile_tok, num_tiles = schedule.prefill_tiles(
        jnp.asarray(cu),
        jnp.asarray([num_decode, num_seqs], jnp.int32),
        num_tokens=num_tokens,
        tokens_per_tile=tpt,
    )
    seqs, toks = _tiles_numpy(q_lens, num_decode, tpt)
    assert int(num_tiles) == len(seqs)
    np.testing.assert_array_equal(np.asarray(tile_seq)[: len(seqs)], seqs)
    np.testing.assert_array_equal(np.asarray(tile_tok)[: len(toks)], toks)


def _step(q_lens, kv_lens, num_decode, max_seqs=8, pad_tokens=5):
    cu = np.zeros(max_seqs + 1, np.int32)
    cu[1 : len(q_lens) + 1] = np.cumsum(q_lens)
    cu[len(q_lens) + 1 :] = cu[len(q_lens)]
    lens = np.zeros(max_seqs, np.int32)
    lens[: len(kv_lens)] = kv_lens
    dist = np.asarray([num_decode, len(q_lens)], np.int32)
    return cu, lens, dist, int(cu[-1]) + pad_tokens


def _parts(cu, lens, dist, num_tokens, *, tpt, bk=64, hkv=2, num_ctas=8, max_splits=1):
    plan = schedule.prefill_parts(
        jnp.asarray(cu),
        jnp.asarray(lens),
        jnp.asarray(dist),
        num_tokens=num_tokens,
        tokens_per_tile=tpt,
        block_kv=bk,
        num_kv_heads=hkv,
        num_ctas=num_ctas,
        max_splits=max_splits,
    )
    n = int(plan.meta[schedule.META_NUM_PARTS])
    return plan, np.asarray(plan.parts)[:n]


def _blocks_numpy(cu, lens, dist, tpt, bk):
    """(seq, first token, KV blocks up to its last token's position) of every tile."""
    tiles = []
    for s in range(int(dist[0]), int(dist[1])):
        q_len = int(cu[s + 1] - cu[s])
        for t in range(0, q_len, tpt):
            last = min(t + tpt, q_len) - 1
            tiles.append((s, int(cu[s]) + t, -(-(int(lens[s]) - q_len + last + 1) // bk)))
    return tiles


def test_unsplit_parts_are_the_tiles_from_last_to_first():
    cu, lens, dist, t = _step([1, 1, 40, 9, 17], [30, 7, 300, 9, 100], num_decode=2)
    plan, parts = _parts(cu, lens, dist, t, tpt=8)
    tiles = _blocks_numpy(cu, lens, dist, 8, 64)[::-1]
    assert len(parts) == len(tiles)
    for row, (seq, tok, nb) in zip(parts, tiles, strict=True):
        assert row[schedule.PART_SEQ] == seq and row[schedule.PART_TOK0] == tok
        assert (row[schedule.PART_B0], row[schedule.PART_B1]) == (0, nb)
        assert (row[schedule.PART_INDEX], row[schedule.PART_COUNT]) == (0, 1)
    assert int(plan.meta[schedule.META_NUM_DECODE]) == 2


@pytest.mark.parametrize("max_splits", [2, 4])
def test_split_parts_cover_each_tile_once(max_splits):
    # One long chunk after a cached prefix and a short one: few tiles for 8 SMs x 2 kv heads.
    cu, lens, dist, t = _step([1, 50, 6], [90, 1000, 6], num_decode=1)
    plan, parts = _parts(cu, lens, dist, t, tpt=16, max_splits=max_splits)
    tiles = _blocks_numpy(cu, lens, dist, 16, 64)
    counts = np.asarray(plan.tile_parts)
    assert counts.max() == max_splits  # the long tiles were cut (the case means something)
    assert counts[len(tiles) :].sum() == 0
    for index, (seq, tok, nb) in enumerate(tiles):
        rows = parts[parts[:, schedule.PART_TILE] == index]
        k = int(counts[index])
        assert len(rows) == k and set(rows[:, schedule.PART_COUNT]) == {k}
        assert list(rows[:, schedule.PART_INDEX]) == list(range(k))  # together, in order
        assert np.all(rows[:, schedule.PART_SEQ] == seq) and np.all(
            rows[:, schedule.PART_TOK0] == tok
        )
        b0, b1 = rows[:, schedule.PART_B0], rows[:, schedule.PART_B1]
        assert b0[0] == 0 and b1[-1] == nb and np.all(b0[1:] == b1[:-1]) and np.all(b1 > b0)
    # Tiles from the last to the first.
    order = [int(r[schedule.PART_TILE]) for r in parts]
    assert order == sorted(order, reverse=True)


def test_parts_are_not_cut_when_tiles_are_plenty():
    cu, lens, dist, t = _step([200, 200], [200, 400], num_decode=0)
    plan, parts = _parts(cu, lens, dist, t, tpt=8, num_ctas=4, max_splits=4)
    assert np.all(parts[:, schedule.PART_COUNT] == 1)
    assert len(parts) == 50


def test_padding_tokens_become_a_sequence_without_kv():
    """with_padding_sequence: padding sequences emptied (whatever their cu and kv_lens held), one
    more prefill sequence over the padding tokens with kv_len 0, whose tiles have no KV blocks."""
    cu, lens, dist, t = _step([1, 1, 40], [30, 7, 300], num_decode=2, pad_tokens=21)
    cu[4:] += 3  # padding sequences' offsets and lengths carry no meaning (reference.py)
    lens[3:] = 99
    ext_lens, ext_cu, ext_dist = schedule.with_padding_sequence(
        jnp.asarray(lens), jnp.asarray(cu), jnp.asarray(dist), num_tokens=t
    )
    valid = int(cu[3])
    np.testing.assert_array_equal(np.asarray(ext_cu), [*cu[:4], *[valid] * 5, t])
    np.testing.assert_array_equal(np.asarray(ext_lens), [30, 7, 300] + [0] * 6)
    np.testing.assert_array_equal(np.asarray(ext_dist), [2, 9])
    plan, parts = _parts(ext_cu, ext_lens, ext_dist, t, tpt=8, max_splits=4)
    pad = parts[parts[:, schedule.PART_SEQ] == 8]
    # Tiles from the last to the first: the padding tokens' tiles come first.
    assert list(pad[:, schedule.PART_TOK0]) == [valid + 16, valid + 8, valid]
    assert np.all(pad[:, schedule.PART_B1] == 0) and np.all(pad[:, schedule.PART_COUNT] == 1)
    chunk = parts[parts[:, schedule.PART_SEQ] == 2]
    assert len(set(chunk[:, schedule.PART_TILE])) == 5 and np.all(chunk[:, schedule.PART_B1] > 0)
    assert len(parts) == len(pad) + len(chunk)  # nothing for the emptied padding sequences


def test_merge_weighs_parts_by_their_log_sum_exp():
    """Rows of a split tile: the parts merged by 2^lse; of other tiles and decode rows: part 0.
    Never-written memory (NaN here) of parts a tile does not have never leaks."""
    rng = np.random.default_rng(0)
    g, tpw, wgs, d, hkv = 2, 4, 2, 8, 1
    # Tokens: 1 decode token, then a prefill of 12 tokens in tiles of 8 (tile 0: tokens 1-8,
    # split in 3 parts; tile 1: tokens 9-12, whole), padded to 14 tokens.
    cu = jnp.asarray([0, 1, 13, 13], jnp.int32)
    dist = jnp.asarray([1, 2], jnp.int32)
    tile_tok = jnp.asarray([1, 9, 17, 25], jnp.int32)
    tile_parts = jnp.asarray([3, 1, 0, 0], jnp.int32)
    t, k = 14, 4
    out = np.full((k, t, hkv, g, d), np.nan, np.float32)
    out[0] = rng.standard_normal((t, hkv, g, d))
    out[1:3, 1:9] = rng.standard_normal((2, 8, hkv, g, d))  # tile 0's tokens, parts 1 and 2
    lse = np.full((k, hkv, 4 * wgs, 64), np.nan, np.float32)
    lse[:3, :, 0:2] = rng.standard_normal((3, hkv, 2, 64)) * 3
    lse[2, 0, 0, 3] = -np.inf  # a row that saw no key of part 2
    merged = np.asarray(
        merge_prefill_parts(
            jnp.asarray(out),
            jnp.asarray(lse),
            tile_tok,
            tile_parts,
            cu,
            dist,
            group=g,
            tokens_per_wg=tpw,
            boxes_per_tile=wgs,
        )
    )
    expected = out[0].copy()
    for tok in range(1, 9):
        wg = (tok - 1) // tpw
        for h in range(g):
            row = (tok - 1 - wg * tpw) * g + h
            w = 2.0 ** lse[:3, 0, wg, row]
            o = out[:3, tok, 0, h]
            expected[tok, 0, h] = (w[:, None] * o).sum(0) / w.sum()
    np.testing.assert_allclose(merged, expected, rtol=1e-5, atol=1e-6)


def test_longest_chain_follows_the_kernels_snake():
    """The cost model's per-CTA sums are those of the items each CTA takes in the kernel
    (mgpu_items.snake_item / snake_count), for item counts short of, at and past a round."""
    rng = np.random.default_rng(5)
    for n, ctas in ((5, 7), (7, 7), (30, 7), (301, 132)):
        costs = rng.uniform(0.5, 9.0, size=n).astype(np.float32)
        loads = []
        for cta in range(ctas):
            count = int(snake_count(jnp.int32(n), jnp.int32(cta), ctas))
            loads.append(sum(costs[int(snake_item(jnp.int32(cta), jnp.int32(i), ctas))]
                             for i in range(count)))  # fmt: skip
        got = float(schedule.longest_chain(jnp.asarray(costs), ctas))
        assert got == pytest.approx(max(loads), rel=1e-6)


def _one_chunk(q_len: int, prefix: int, *, hq: int, hkv: int, choose=schedule.per_step_parts):
    """The per-step plan of one prefill chunk in its own bucket (64-token pages' 128-token
    blocks, 132 CTAs), as pallas_attention builds it."""
    cu = jnp.asarray([0, q_len, q_len], jnp.int32)  # the chunk and one empty padding sequence
    kv_lens = jnp.asarray([prefix + q_len, 0], jnp.int32)
    lens, cu, dist = schedule.with_padding_sequence(
        kv_lens, cu, jnp.asarray([0, 1], jnp.int32), num_tokens=q_len
    )
    return choose(cu, lens, dist, num_tokens=q_len, tokens_per_wg=64 // (hq // hkv),
                  block_kv=128, num_kv_heads=hkv, num_ctas=132, decode_splits=1)  # fmt: skip


# The H100 A/B the cost model was fitted to (docs/benchmarks.md, "Prefill tiles on both compute
# warpgroups", kernel us): every pair whose forms differed beyond their spread. 32q/8kv/64 at 512
# tokens was even (9.9-10.1 both) and is not asserted.
@pytest.mark.parametrize(
    "hq, hkv, q_len, prefix, interleaved",
    [
        (9, 3, 512, 0, True),  # 7.7-7.9 interleaved, 10.0-10.1 paired
        (9, 3, 1024, 0, True),  # 10.5-10.7 against 14.6-14.8
        (9, 3, 512, 7680, True),  # 47.7-47.9 against 78.2
        (9, 3, 1024, 7168, False),  # 83.7-84.7 against 78.5-78.7
        (32, 8, 1024, 0, False),  # 22.2-22.4 against 17.5-17.7
    ],
)
def test_interleave_pays_where_it_measured_faster(hq, hkv, q_len, prefix, interleaved):
    plan = _one_chunk(q_len, prefix, hq=hq, hkv=hkv)
    assert int(plan.meta[schedule.META_INTERLEAVE]) == interleaved


def test_per_step_parts_are_one_of_the_two_plans():
    """The selected plan is the one-box tiles' or the two-box tiles' (padded), as meta says."""
    for q_len, prefix in ((512, 0), (1024, 7168)):
        plan = _one_chunk(q_len, prefix, hq=9, hkv=3)
        tpw = 64 // 3
        boxes = 1 if int(plan.meta[schedule.META_INTERLEAVE]) else 2

        def static_plan(*a, tokens_per_wg, decode_splits, boxes=boxes, **kw):
            return schedule.prefill_parts(*a, tokens_per_tile=tokens_per_wg * boxes, **kw)

        static = _one_chunk(q_len, prefix, hq=9, hkv=3, choose=static_plan)
        rows = static.parts.shape[0]
        np.testing.assert_array_equal(plan.parts[:rows], static.parts)
        np.testing.assert_array_equal(plan.parts[rows:], 0)
        np.testing.assert_array_equal(plan.meta[:3], static.meta[:3])
        # the one-box tiles' rows: the chunk, the empty sequence and the padding one
        assert plan.parts.shape[0] == schedule.max_prefill_tiles(q_len, 3, tpw)


def test_token_metadata_matches_a_plain_loop():
    cu = jnp.asarray([0, 1, 2, 7, 10, 10], jnp.int32)  # 2 decodes, prefills of 5 and 3, 1 unused
    kv_lens = jnp.asarray([9, 4, 5, 20, 0], jnp.int32)
    seq_ids, q_pos, valid = token_metadata(kv_lens, cu, jnp.asarray([2, 4], jnp.int32), 12)
    np.testing.assert_array_equal(seq_ids[:10], [0, 1, 2, 2, 2, 2, 2, 3, 3, 3])
    np.testing.assert_array_equal(q_pos, [8, 3, 0, 1, 2, 3, 4, 17, 18, 19, -1, -1])
    np.testing.assert_array_equal(valid, [True] * 10 + [False] * 2)


def _lowered_text(fn, *args) -> str:
    return jax.jit(fn).lower(*args).as_text()


def test_step_metadata_has_no_while_loop():
    cu = jnp.zeros(257, jnp.int32)
    dist = jnp.zeros(2, jnp.int32)
    texts = [_lowered_text(lambda k, c, d: token_metadata(k, c, d, 512), cu[:-1], cu, dist)]
    pad = functools.partial(schedule.with_padding_sequence, num_tokens=512)
    texts.append(_lowered_text(pad, cu[:-1], cu, dist))
    for max_splits in (1, 4):
        plan = lambda c, k, d, m=max_splits: schedule.prefill_parts(  # noqa: E731
            c, k, d, num_tokens=512, tokens_per_tile=32, block_kv=64, num_kv_heads=2,
            num_ctas=132, max_splits=m,
        )  # fmt: skip
        texts.append(_lowered_text(plan, cu, cu[:-1], dist))
    per_step = lambda c, k, d: schedule.per_step_parts(  # noqa: E731
        c, k, d, num_tokens=512, tokens_per_wg=16, block_kv=64, num_kv_heads=2, num_ctas=132,
        decode_splits=2,
    )  # fmt: skip
    texts.append(_lowered_text(per_step, cu, cu[:-1], dist))
    k, g, tpw, wgs = 4, 2, 16, 2
    out = jnp.zeros((k, 512, 2, g, 64), jnp.bfloat16)
    lse = jnp.zeros((k, 2, (512 // 32 + 256) * wgs, 64), jnp.float32)
    tiles = jnp.zeros(512 // 32 + 256, jnp.int32)
    merge = functools.partial(merge_prefill_parts, group=g, tokens_per_wg=tpw, boxes_per_tile=wgs)
    texts.append(_lowered_text(merge, out, lse, tiles, tiles, cu, dist))
    for text in texts:
        assert "while" not in text
