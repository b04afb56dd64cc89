"""Counts XLA programs built in this process, so tests and /metrics can prove zero after warm-up.

Every jit cache miss lowers a jaxpr to an MLIR module, whether the binary then comes from the
persistent cache or the compiler; that lowering event is what is counted.
"""

from __future__ import annotations

import threading

import jax

_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_lock = threading.Lock()
_count = 0
_installed = False


def _listener(event: str, duration: float, **_: object) -> None:
    global _count
    if event == _EVENT:
        with _lock:
            _count += 1


def install() -> None:
    global _installed
    with _lock:
        if not _installed:
            jax.monitoring.register_event_duration_secs_listener(_listener)
            _installed = True


def compile_count() -> int:
    install()
    return _count
