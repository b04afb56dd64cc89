"""How the server's helper processes (the engine core, extra API servers) live and die with the
process that started them.

- `die_with_parent`: Linux delivers a signal to this process when its parent exits, so nothing
  outlives a server that was killed (SIGKILL gives it no chance to stop its children). Linux
  sends it when the parent *thread* that started the process ends: only for processes started by
  threads that live as long as their parent (the extra API servers; the engine core, started
  from pools and reader threads too, watches its parent's id instead).
- `leave_signals_to_parent`: a terminal's Ctrl-C (SIGINT) and `kill -TERM` of a process group
  reach every process of the group at once; the engine core ignores both, so the API server can
  drain its requests on the core before stopping it.
"""

from __future__ import annotations

import ctypes
import os
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Have the kernel send `sig` to this process when its parent exits (Linux; elsewhere a
    no-op)."""
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, sig)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent exited before the call
        os.kill(os.getpid(), sig)


def leave_signals_to_parent() -> None:
    """Ignore SIGINT and SIGTERM: the parent stops this process (a message, else a kill)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
