"""Which sampler program a step needs, decided on the host from the rows' settings (JAX-free).

The sampler (`executor/sampler.py`) has no data-dependent control flow: a step runs one of a few
static programs, the cheapest that samples every row exactly, chosen here from settings the host
already holds:
  - GREEDY: every row has temperature 0 (argmax only);
  - RANDOM: random rows, none with a min-p / top-k / top-p filter (Gumbel-max over the
    vocabulary);
  - FILTER(R): some random rows filter; their rows are gathered into a static bucket of R rows,
    sorted (the min-p floor and the exact top-k / top-p threshold), and the thresholds scattered
    back.
On XLA:GPU `lax.top_k` with k > 16 is a full sort (measured on the H200: 4.0 ms for 1,024 x 49,152
whatever k from 64 to 1,024; docs/benchmarks.md), so sorting only the rows that filter, in a
bucket sized to them, is what keeps the cost in proportion.

What a row computes depends on its own settings only, never on its neighbours or the program, so
a request's tokens are the same alone and in any batch.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True, order=True)
class SamplerProgram:
    kind: str  # "greedy" | "random" | "filter"
    filter_rows: int = 0  # R, for "filter"

    @property
    def name(self) -> str:
        return f"filter-{self.filter_rows}" if self.kind == "filter" else self.kind


GREEDY = SamplerProgram("greedy")
RANDOM = SamplerProgram("random")


def filter_buckets(max_num_seqs: int) -> list[int]:
    """Sizes of the filtered-row bucket: powers of 4 from 16, and max_num_seqs itself."""
    sizes, r = [], 16
    while r < max_num_seqs:
        sizes.append(r)
        r *= 4
    return sizes + [max_num_seqs]


def sampler_programs(max_num_seqs: int, rows: int | None = None) -> list[SamplerProgram]:
    """Every program `choose_program` can pick for a step of at most `rows` rows (default
    `max_num_seqs`): a filter bucket holds the filtering rows, of which there are at most `rows`."""
    rows = max_num_seqs if rows is None else min(rows, max_num_seqs)
    sizes = filter_buckets(max_num_seqs)
    needed = [r for r in sizes if r < rows] + [next(r for r in sizes if r >= rows)]
    return [GREEDY, RANDOM] + [SamplerProgram("filter", r) for r in needed]


def multi_step_programs(
    buckets: list[int], max_num_seqs: int, max_rows: int
) -> list[tuple[int, SamplerProgram]]:
    """(token bucket, sampler program) of every multi-step launch of at most `max_rows` decode
    rows (one token each): the buckets up to the one that holds them, and the programs
    `choose_program` can pick for that many rows."""
    rows = min(max_rows, max_num_seqs)
    top_bucket = next((b for b in buckets if b >= rows), buckets[-1])
    programs = sampler_programs(max_num_seqs, rows)
    return [(b, p) for b in buckets if b <= top_bucket for p in programs]


# Temperatures below this sample greedily (vLLM's _SAMPLING_EPS): logits / T overflows float32
# for T near 1e-38 (a logit of 5 / 1.2e-38 is inf), and the overflowed tokens then tie, so the
# draw would pick the lowest id among them, or token 0 once top-p's softmax turns them to NaN.
GREEDY_BELOW_TEMPERATURE = 1e-5


def effective_temperature(temperature: float) -> float:
    """The temperature a row samples at: 0.0 (greedy) below GREEDY_BELOW_TEMPERATURE."""
    return 0.0 if temperature < GREEDY_BELOW_TEMPERATURE else temperature


def normalize_top_k(top_k: int, vocab_size: int) -> int:
    """0 (off) for a top_k that keeps the whole vocabulary; the value otherwise."""
    return 0 if top_k <= 0 or top_k >= vocab_size else top_k


def filters(temperature, top_p, top_k, min_p=None):
    """Rows whose sample is restricted by top-k, top-p or min-p (numpy or jnp arrays)."""
    restricted = (top_k > 0) | (top_p < 1.0)
    if min_p is not None:
        restricted = restricted | (min_p > 0.0)
    return (temperature > 0.0) & restricted


def choose_program(
    temperature: np.ndarray,
    top_p: np.ndarray,
    top_k: np.ndarray,
    max_num_seqs: int,
    min_p: np.ndarray | None = None,
) -> tuple[SamplerProgram, np.ndarray]:
    """The cheapest exact program for these rows, and the indices of the rows that filter.

    `top_k` must already be 0 where it is off or covers the vocabulary (`normalize_top_k`).
    """
    if not (temperature > 0.0).any():
        return GREEDY, np.zeros(0, np.int64)
    rows = np.flatnonzero(filters(temperature, top_p, top_k, min_p))
    if not len(rows):
        return RANDOM, rows
    r = next(b for b in filter_buckets(max_num_seqs) if b >= len(rows))
    return SamplerProgram("filter", r), rows
