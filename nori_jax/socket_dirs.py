"""The private directories that hold a server's ZeroMQ ipc sockets (`nori-core-<pid>-*` for the
engine core's, `nori-api-<pid>-*` for the extra API servers'), created mode 0700 by the process
whose id they carry and removed by it when it stops.

A process that is killed outright (SIGKILL) removes nothing: the next server to create such a
directory removes those whose creator no longer runs, so they do not pile up in /tmp.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile

_NAME = re.compile(r"nori-(?:core|api)-(\d+)-")


def socket_dir(kind: str) -> str:
    """A fresh private directory for `kind` ("core" or "api"), after removing stale ones."""
    remove_stale()
    return tempfile.mkdtemp(prefix=f"nori-{kind}-{os.getpid()}-")


def remove_stale(root: str | None = None) -> list[str]:
    """Remove this user's socket directories whose creator no longer runs; the paths removed."""
    root = root or tempfile.gettempdir()
    removed = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    for entry in entries:
        match = _NAME.match(entry.name)
        if match is None or not entry.is_dir(follow_symlinks=False):
            continue
        try:
            if entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue  # another user's: not ours to judge
        except OSError:
            continue
        if not _running(int(match.group(1))):
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
