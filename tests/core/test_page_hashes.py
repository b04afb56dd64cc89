"""Page content keys: the chained form the scheduler uses equals `page_hash` page by page."""

from __future__ import annotations

import numpy as np

from nori_jax.core.paging import ROOT_HASH, chain_page_hashes, page_hash
from nori_jax.core.request import Request
from nori_jax.sampling_params import SamplingParams


def test_chain_page_hashes_equals_page_hash_one_page_at_a_time():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 2**31 - 1, 5 * 16 + 7).astype(np.int32)  # 5 full pages and a tail
    expected, parent = [], ROOT_HASH
    for i in range(5):
        parent = page_hash(parent, tokens[i * 16 : (i + 1) * 16].tolist())
        expected.append(parent)
    assert chain_page_hashes(ROOT_HASH, tokens, 16) == expected  # the partial page: no key
    # Continuing a chain from a page already hashed gives the same keys.
    assert chain_page_hashes(expected[1], tokens[32:], 16) == expected[2:]


def test_token_array_spans_prompt_and_output_and_leaves_the_prompt_read_only():
    req = Request("r", [1, 2, 3, 4], SamplingParams(max_tokens=4), seed=0)
    req.output_token_ids += [5, 6]
    assert req.token_array(1, 3).tolist() == [2, 3]
    assert req.token_array(2, 6).tolist() == [3, 4, 5, 6]
    assert req.token_array(4, 6).tolist() == [5, 6]
    assert not req.token_array(0, 2).flags.writeable
    assert req.token_array(0, 6).tolist() == req.token_ids(0, 6)
