"""A heartbeat from API servers 1.. to API server 0: a file whose modification time the server's
event loop sets every HEARTBEAT_S. A stopped process (SIGSTOP), a stuck event loop or a deadlock
stops it, while the process still runs and the kernel still hands it new connections on the
shared port (SO_REUSEPORT), which then wait for ever; API server 0 kills such a one and
restarts it (serve/api_servers.py)."""

from __future__ import annotations

import asyncio
import os
import time

HEARTBEAT_S = 1.0


def touch(path: str) -> None:
    with open(path, "a"):
        os.utime(path)


async def beat(path: str) -> None:
    """Set the file's time every HEARTBEAT_S from the event loop, until cancelled."""
    while True:
        touch(path)
        await asyncio.sleep(HEARTBEAT_S)


def age_s(path: str) -> float | None:
    """Seconds since the last beat, or None before the first (the process is starting)."""
    try:
        return time.time() - os.stat(path).st_mtime
    except FileNotFoundError:
        return None
