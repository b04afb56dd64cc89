"""Which sampler program a step needs, decided on the host from the rows' settings (JAX-free).

The sampler (`executor/sampler.py`) has no data-dependent control flow: a step runs one of a few
static programs, the cheapest that samples every row exactly. The row classes below are shared by
the host's choice and the device's per-row selection, so the two always agree. They work on numpy
and jnp arrays alike.
"""

from __future__ import annotations

import enum

import numpy as np

# Widest top-k served by `lax.top_k`; wider filters take the FULL program's sort. vLLM users'
# top_k values are far below this (20-100 are typical).
DEFAULT_TOP_K_CAP = 256


class SamplerMode(enum.IntEnum):
    GREEDY = 0  # every row has temperature 0: argmax only
    SAMPLE = 1  # random rows, none filtering beyond the top-k cap
    FULL = 2  # some random row needs the full-vocabulary filter


def normalize_top_k(top_k: int, vocab_size: int) -> int:
    """0 (off) for a top_k that keeps the whole vocabulary; the value otherwise."""
    return 0 if top_k <= 0 or top_k >= vocab_size else top_k


def needs_full_filter(top_p, top_k, cap: int, vocab_size: int):
    """Rows whose top-k / top-p set may reach past the top-`cap` set."""
    if cap >= vocab_size:
        return top_k < 0  # all False: the capped path sees the whole vocabulary
    return (top_k > cap) | ((top_k == 0) & (top_p < 1.0))


def uses_capped_filter(top_p, top_k, cap: int, vocab_size: int):
    """Rows filtered inside the top-`cap` set: a top_k within it (or any filter when the cap
    covers the vocabulary)."""
    in_cap = (top_k > 0) & (top_k <= cap)
    if cap >= vocab_size:
        in_cap = in_cap | (top_p < 1.0)
    return in_cap


def choose_mode(
    temperature: np.ndarray, top_p: np.ndarray, top_k: np.ndarray, cap: int, vocab_size: int
) -> SamplerMode:
    """The cheapest program that samples every given row exactly.

    `top_k` must already be 0 where it is off or covers the vocabulary (`normalize_top_k`).
    """
    random = temperature > 0.0
    if not random.any():
        return SamplerMode.GREEDY
    if (random & needs_full_filter(top_p, top_k, min(cap, vocab_size), vocab_size)).any():
        return SamplerMode.FULL
    return SamplerMode.SAMPLE
