"""The private directories that hold a server's ZeroMQ ipc sockets (`nori-core-*` for the engine
core's, `nori-api-*` for the extra API servers'), created mode 0700 by a process that writes its
id into them (`owner.pid`; not into the name: an ipc address must fit a socket path's 107 bytes,
and pytest's or a user's TMPDIR can be long) and removes them when it stops.

A process that is killed outright (SIGKILL) removes nothing: the next server to create such a
directory removes those whose creator no longer runs, so they do not pile up in /tmp.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile

_NAME = re.compile(r"nori-(?:core|api)-")
_OWNER = "owner.pid"


def socket_dir(kind: str) -> str:
    """A fresh private directory for `kind` ("core" or "api"), after removing stale ones."""
    remove_stale()
    path = tempfile.mkdtemp(prefix=f"nori-{kind}-")
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
