"""Paged incremental decoding computes the same logits as one full forward pass."""

from __future__ import annotations

import numpy as np
import pytest
from model_harness import PagedSequence, load

TOKENS = [(i * 37 + 11) % 300 + 3 for i in range(70)]


@pytest.mark.parametrize("chunks", [[70], [33, 1, 1, 1, 34], [16, 16, 5, 1, 32], [1] * 20 + [50]])
def test_chunked_and_incremental_decode_equal_full_forward(hf_checkpoints, chunks):
    loaded = load(hf_checkpoints["llama"])
    full = PagedSequence(loaded, seed=1).feed(TOKENS)
    seq, parts, start = PagedSequence(loaded, seed=2), [], 0
    for n in chunks:
        parts.append(seq.feed(TOKENS[start : start + n]))
        start += n
    np.testing.assert_allclose(np.concatenate(parts), full, rtol=1e-5, atol=1e-5)
