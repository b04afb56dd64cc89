"""Keep Python's cyclic garbage collector off the start-up heap while the step loop runs.

A built engine holds a few hundred thousand container objects (JAX and XLA's Python side, the
model's modules, the tokenizer, FastAPI's routes in a server). The cyclic collector walks all of
them in every full (oldest-generation) collection: 30-160 ms each on the development machine,
several times in a 2,000-request run. No step is launched meanwhile, so the GPU idles and every
stream in flight sees the pause in its inter-token latency (a served run's TTFT and TPOT P99).

`gc.freeze()` moves every object that exists now into a permanent generation that collections
skip; what the loop makes afterwards (requests, outputs) is collected as usual, and reference
counting still frees frozen objects the moment nothing refers to them. Only garbage *cycles*
among frozen objects wait, until `gc.unfreeze()`. So a process that is nothing but the engine
(the engine-core process, a multi-host follower) freezes for good once it is built, and a loop in
someone else's process (`LLM.generate`, the in-process async engine, a server's lifespan)
freezes for its own duration and hands the heap back after.

`NORI_JAX_FREEZE_GC=0` in the environment turns all of it off (to measure what it buys, or to rule
it out when memory grows).
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
from collections.abc import Iterator


def enabled() -> bool:
    return os.environ.get("NORI_JAX_FREEZE_GC", "1") != "0"


def freeze_process_heap() -> None:
    """For a process that is only the engine: collect once, then freeze everything for good."""
    if not enabled():
        return
    gc.collect()
    gc.freeze()


_lock = threading.Lock()
_depth = 0  # heap_frozen blocks open; the outermost freezes and unfreezes


@contextlib.contextmanager
def heap_frozen(collect: bool = False) -> Iterator[None]:
    """Freeze the heap for the duration and unfreeze it after.

    Nested or concurrent blocks (a server's lifespan around the in-process engine's loop) share
    one freeze, which the last to leave lifts. `collect` runs a full collection first, so that
    garbage of the set-up is freed rather than frozen (worth its tens of milliseconds once per
    server, not per `generate`). Not `gc.get_freeze_count()` to tell whether the heap is frozen:
    the interpreter may start with some objects frozen."""
    global _depth
    if not enabled():
        yield
        return
    with _lock:
        _depth += 1
        if _depth == 1:
            if collect:
                gc.collect()
            gc.freeze()
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                gc.unfreeze()
