"""A client that reads nothing of its response is dropped after the write timeout (serve/server.py,
guarded_protocol): its connection is reset, the response sees the disconnect, and a reader beside
it is served throughout. The server's own endpoints then abort the request's choices on that
disconnect as for any client that went away (tests/serve/test_concurrency.py)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
import uvicorn

from serve.server import guarded_protocol

CHUNK = b"x" * 65536
WRITE_TIMEOUT_S = 1.0


class Endless:
    """An ASGI app streaming 64 KiB chunks until its client goes away; records how each ended."""

    def __init__(self) -> None:
        self.ended: list[str] = []

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        gone = asyncio.Event()

        async def watch() -> None:  # ASGI 2.3: a disconnect is seen through receive()
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()

        watcher = asyncio.create_task(watch())
        await send({"type": "http.response.start", "status": 200, "headers": []})
        started = time.monotonic()
        while not gone.is_set() and time.monotonic() - started < 30:
            await send({"type": "http.response.body", "body": CHUNK, "more_body": True})
            await asyncio.sleep(0)
        watcher.cancel()
        self.ended.append("disconnect" if gone.is_set() else "still writing after 30 s")


@pytest.fixture(scope="module")
def endless():
    app = Endless()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(
        app, log_level="error", http=guarded_protocol(30.0, WRITE_TIMEOUT_S), lifespan="off"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    yield app, sock.getsockname()[1]
    server.should_exit = True
    thread.join(10)


def _request(port: int, rcvbuf: int | None = None) -> socket.socket:
    s = socket.socket()
    if rcvbuf is not None:  # before connecting: the window the server may fill
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect(("127.0.0.1", port))
    s.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    return s


def test_a_client_that_reads_nothing_is_dropped_and_a_reader_is_not(endless) -> None:
    app, port = endless
    stalled = _request(port, rcvbuf=4096)
    reader = _request(port)
    reader.settimeout(5)
    got = 0
    started = time.monotonic()
    # The reader reads for longer than the write timeout: it stays connected throughout.
    while time.monotonic() - started < 3 * WRITE_TIMEOUT_S:
        data = reader.recv(1 << 20)
        assert data, "the reading client's connection was closed"
        got += len(data)
    assert got > 10 * len(CHUNK)
    # The stalled one was reset by the server: what it reads now ends in a reset (or EOF once its
    # buffered bytes are read).
    stalled.settimeout(5)
    ended = None
    try:
        while stalled.recv(1 << 20):
            pass
        ended = "eof"
    except ConnectionResetError:
        ended = "reset"
    assert ended in ("eof", "reset")
    assert app.ended == ["disconnect"]  # the stalled response saw its client gone
    reader.close()
    stalled.close()
