"""Device time per call of a short program: calls dispatched back to back, one wait at the end.

A wait after every call lets the GPU go idle between calls, and an idle H200 drops its SM clock
(345 MHz against 1,980 at full speed, read with nvidia-smi between calls); a call of 100-200 us
then runs mostly at a ramping clock. Measured on the H200 (2026-12-04, docs/benchmarks.md): a
bf16 matmul of 16 tokens against a 4096 x 14336 weight took 90 us timed one call at a time and
40 us in a stream of ten; an engine's forward pass keeps the GPU busy, so the stream is what it
sees.
"""

from __future__ import annotations

import statistics
import time

import jax


def time_stream(fn, *args, calls: int = 10, trials: int = 5) -> float:
    """Median over `trials` of the wall time of `calls` back-to-back calls of fn(*args), per call
    (after a warm-up stream)."""
    jax.block_until_ready([fn(*args) for _ in range(calls)])
    times = []
    for _ in range(trials):
        t0 = time.perf_counter()
        jax.block_until_ready([fn(*args) for _ in range(calls)])
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def time_each_call(fn, *args, calls: int = 20) -> float:
    """Median wall time of one call with a wait after it: what the stream avoids (the GPU idles
    between calls and its clock drops); kept to show the difference (`--per-call`)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
