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


def test_the_scheduler_extends_a_request_chain_page_by_page():
    """Keys added a few pages at a time (prompt pages at admission, then the page across prompt
    and output, then output pages as they fill) are the chain over prompt + output at once."""
    from fake_runner import make_scheduler

    s = make_scheduler(page_size=16)
    req = Request("r", list(range(100, 140)), SamplingParams(max_tokens=60), seed=0)
    req.output_token_ids += list(range(2000, 2056))  # 96 tokens: 6 full pages
    expected = chain_page_hashes(ROOT_HASH, req.token_array(0, 96), 16)
    assert s._hash_pages(req, 2) == expected[:2]  # prompt pages
    assert s._hash_pages(req, 3) == expected[:3]  # the page across prompt and output
    assert s._hash_pages(req, 6) == expected  # output pages alone
    assert s._page_hashes(req, 4) == expected[:4]
