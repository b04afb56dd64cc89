"""The kernel's work-item schedule: right tiles, and no while loop in the step's metadata math.

A while loop in a GPU program waits for the host at every iteration (it reads the predicate back);
computed once per layer, the schedule's former `jnp.searchsorted` loop made the engine's step
host-bound. These tests keep the metadata loop-free.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.ragged_paged_attention import schedule
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
    meta, tile_seq, tile_tok = schedule.prefill_tiles(
        jnp.asarray(cu),
        jnp.asarray([num_decode, num_seqs], jnp.int32),
        num_tokens=num_tokens,
        tokens_per_tile=tpt,
    )
    seqs, toks = _tiles_numpy(q_lens, num_decode, tpt)
    assert int(meta[schedule.META_NUM_TILES]) == len(seqs)
    assert int(meta[schedule.META_NUM_DECODE]) == num_decode
    np.testing.assert_array_equal(np.asarray(tile_seq)[: len(seqs)], seqs)
    np.testing.assert_array_equal(np.asarray(tile_tok)[: len(toks)], toks)


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
    tiles = _lowered_text(
        lambda c, d: schedule.prefill_tiles(c, d, num_tokens=512, tokens_per_tile=32), cu, dist
    )
    meta = _lowered_text(lambda k, c, d: token_metadata(k, c, d, 512), cu[:-1], cu, dist)
    for text in (tiles, meta):
        assert "while" not in text
