"""Counts the XLA programs an engine builds after warm-up, and only those.

Every jit cache miss lowers a jaxpr to an MLIR module, whether the binary then comes from the
persistent cache or the compiler; that lowering event is what is counted. JAX reports the event
to process-wide listeners, so the count is scoped by thread and by `with counter.counting():`
blocks: a lowering is charged to the counters active on the thread that made it. Compiles of a
user's own code, on any thread, outside those blocks, are never charged to the engine. The one
listener is registered when the first counter is made, not at import.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import jax

_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_local = threading.local()
_install_lock = threading.Lock()
_installed = False


def _listener(event: str, duration: float, **_: object) -> None:
    if event == _EVENT:
        for counter in getattr(_local, "active", ()):
            counter.count += 1


def _install() -> None:
    global _installed
    with _install_lock:
        if not _installed:
            jax.monitoring.register_event_duration_secs_listener(_listener)
            _installed = True


class CompileCounter:
    def __init__(self) -> None:
        _install()
        self.count = 0

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        active = getattr(_local, "active", None)
        if active is None:
            active = _local.active = []
        active.append(self)
        try:
            yield
        finally:
            active.remove(self)
