"""The private directories that hold a server's ZeroMQ ipc sockets (`nori-core-*` for the engine
core's, `nori-api-*` for the extra API servers'), created mode 0700 by a process that writes its
id into them (`owner.pid`; not into the name: an ipc address must fit a socket path's 107 bytes)
and removes them when it stops.

They go in the temporary directory (TMPDIR) where its socket paths fit, else in /tmp: pytest's,
a build system's or a user's TMPDIR can be long enough that ZeroMQ refuses every address in it.

A process that is killed outright (SIGKILL) removes nothing: the next server to create such a
directory removes those whose creator no longer runs, so they do not pile up in /tmp.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile

logger = logging.getLogger(__name__)

_NAME = re.compile(r"nori-(?:core|api)-")
_OWNER = "owner.pid"
IPC_PATH_MAX = 107  # bytes of a socket's path: sockaddr_un.sun_path less its terminator
# The longest socket name a directory holds ("api-999-out", "out-99999": an API server's index,
# a core's restart count) and mkdtemp's directory name ("nori-core-" and 8 random characters).
_NAME_ROOM = 16
_DIR_ROOM = len("nori-core-") + 8
FALLBACK_ROOT = "/tmp"


def _fits(root: str) -> bool:
    longest = os.path.join(root, "d" * _DIR_ROOM, "s" * _NAME_ROOM)
    return len(os.fsencode(longest)) <= IPC_PATH_MAX


def socket_root() -> str:
    """Where socket directories go: the temporary directory, or /tmp where the temporary
    directory's socket paths would be too long. ValueError if neither fits."""
    root = tempfile.gettempdir()
    if _fits(root):
        return root
    if _fits(FALLBACK_ROOT) and os.access(FALLBACK_ROOT, os.W_OK | os.X_OK):
        logger.info(
            "ipc sockets in %s: the temporary directory %s is too long for socket paths (%d bytes)",
            FALLBACK_ROOT,
            root,
            IPC_PATH_MAX,
        )
        return FALLBACK_ROOT
    raise ValueError(
        f"the temporary directory {root!r} is too long for the engine's ipc socket paths "
        f"({IPC_PATH_MAX} bytes at most) and {FALLBACK_ROOT} is not writable: set TMPDIR to a "
        "shorter directory"
    )


def socket_dir(kind: str) -> str:
    """A fresh private directory for `kind` ("core" or "api"), after removing stale ones."""
    root = socket_root()
    remove_stale(root)
    path = tempfile.mkdtemp(prefix=f"nori-{kind}-", dir=root)
    with open(os.path.join(path, _OWNER), "w") as f:
        f.write(str(os.getpid()))
    return path


def remove_stale(root: str | None = None) -> list[str]:
    """Remove this user's socket directories whose creator no longer runs (those without an
    owner file predate it: left alone); the paths removed."""
    root = root or tempfile.gettempdir()
    removed = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    for entry in entries:
        if not _NAME.match(entry.name) or not entry.is_dir(follow_symlinks=False):
            continue
        try:
            if entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue  # another user's: not ours to judge
            with open(os.path.join(entry.path, _OWNER)) as f:
                pid = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if not _running(pid):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists (another user's process)
    return True
