"""uvicorn, with the server's shutdown contract and a header read timeout.

Shutdown (SIGTERM or Ctrl-C): the server keeps listening, so probes get an answer; `/health` and
new work answer 503 with a JSON body; requests in flight may finish within the drain timeout, and
those still running after it end with a JSON error (a stream: an error event, then its usual
end, `[DONE]` on SSE), never cut mid-chunk. Then uvicorn closes the listener and exits. A second
signal stops at once (uvicorn's own shutdown).

Headers: uvicorn bounds only the idle time between requests, and its httptools protocol keeps
every header it is sent: a client that trickles its request line and headers would hold a
connection for ever, and one that sends a gigabyte of headers makes the server hold it.
`guarded_protocol` closes a connection whose headers are not complete within the timeout of
its first byte (or of the connection's start), and answers a 431 (JSON) and closes one whose
request line and headers pass MAX_HEADER_BYTES.

Writes: a client that stops reading a response fills the connection's buffers, and asyncio then
pauses the server's writes to it; a stream's `send` waits while the engine's outputs for it pile
up in the API server (a review measured 33 MB per stalled connection of n=62 choices with top
logprobs, held until the client hung up). `guarded_protocol` drops a connection whose writes stay
paused for the write timeout: its transport is aborted (its buffer freed), the request sees the
disconnect, and its choices are aborted in the engine, as for a client that went away.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from nori_jax.engine_client import EngineClient

if TYPE_CHECKING:
    from serve.api_servers import ApiServers

logger = logging.getLogger(__name__)
# A request's line and headers, together: far above what clients send (a few KiB with cookies
# and tokens; nginx takes 32 KiB by default), far below what would cost the server memory.
MAX_HEADER_BYTES = 64 * 1024


class Server(uvicorn.Server):
    """`companions`: the other API server processes this one started (serve/api_servers.py):
    they get the first signal too, and the engine stops only once they have drained."""

    def __init__(
        self,
        config: uvicorn.Config,
        engine: EngineClient,
        drain_timeout_s: float,
        companions: ApiServers | None = None,
    ):
        super().__init__(config)
        self.engine, self.drain_timeout_s = engine, drain_timeout_s
        self.companions = companions
        self.draining = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """The first signal drains; a second one (or one before serving) stops as uvicorn does.
        Callable from any thread (tests call it directly)."""
        if self.draining or self._loop is None or self.should_exit:
            super().handle_exit(sig, frame)
            return
        self.draining = True
        if self.companions is not None:
            self.companions.terminate()
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        logger.info("draining: up to %g s for %d requests", self.drain_timeout_s, self.in_flight)
        started = time.monotonic()
        try:
            if self.companions is not None:  # they drain too, on the same engine core
                self.engine.stop_accepting()
                await asyncio.to_thread(self.companions.wait, self.drain_timeout_s + 10.0)
            left = max(0.0, self.drain_timeout_s - (time.monotonic() - started))
            await self.engine.shutdown(left)
        except Exception:  # noqa: BLE001 - exit regardless
            logger.exception("drain failed")
        # Every stream has its last item now; uvicorn lets the responses finish writing it.
        self.should_exit = True

    @property
    def in_flight(self) -> int:
        return self.engine.num_in_flight


def guarded_protocol(
    timeout_s: float,
    write_timeout_s: float | None = None,
    max_header_bytes: int = MAX_HEADER_BYTES,
) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol (its C parser: a third less CPU per streamed event than the
    pure-Python h11 one, docs/benchmarks.md), closing connections whose request headers take over
    timeout_s, refusing (431) those whose request line and headers pass max_header_bytes, and
    dropping those whose writes stay paused (the client reads nothing) for write_timeout_s (None:
    never)."""

    class GuardedProtocol(HttpToolsProtocol):
        _header_timer: asyncio.TimerHandle | None = None
        _write_timer: asyncio.TimerHandle | None = None
        _headers_pending = True  # the next bytes belong to a request line or headers
        _header_bytes = 0
        _headers_completed = 0  # requests whose headers were parsed on this connection

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self.transport.is_closing():
                return
            pending, completed = self._headers_pending, self._headers_completed
            super().data_received(data)
            # Counted once parsed: a chunk read while headers were due that completed none is
            # all request line and headers; one that completed some (and may carry a body, or
            # a whole request) is not counted. So the parser holds at most max_header_bytes
            # plus one read of them before the refusal.
            if pending and self._headers_pending and self._headers_completed == completed:
                self._header_bytes += len(data)
                if self._header_bytes > max_header_bytes and not self.transport.is_closing():
                    self._refuse_headers()

        def on_message_begin(self) -> None:  # a request's first byte: its headers are due
            super().on_message_begin()
            if self._header_timer is None:
                self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            self._headers_pending, self._header_bytes = False, 0
            self._headers_completed += 1
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._headers_pending = True  # a kept-alive connection's next request

        def _refuse_headers(self) -> None:
            self._disarm()
            message = f"the request line and headers pass {max_header_bytes} bytes"
            self.transport.write(
                _json_error(b"431 Request Header Fields Too Large", message, "headers_too_large")
            )
            self.transport.close()

        def send_400_response(self, msg: str) -> None:
            # uvicorn's answer to a request its parser refuses (a bad Content-Length, a method
            # or header that is not HTTP) is a text/plain 400 saying only "Invalid HTTP request
            # received."; ours is the JSON error, with the parser's reason. uvicorn calls this
            # from its `except httptools.HttpParserError`, so that error is being handled here.
            why = sys.exception()
            message = f"invalid HTTP request: {why}" if why is not None else msg
            self.transport.write(_json_error(b"400 Bad Request", message, "invalid_http_request"))
            self.transport.close()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            self._resume_timer()
            super().connection_lost(exc)

        def pause_writing(self) -> None:  # asyncio: the transport's buffer passed its high mark
            super().pause_writing()
            if write_timeout_s is not None and self._write_timer is None:
                self._write_timer = self.loop.call_later(write_timeout_s, self._write_stalled)

        def resume_writing(self) -> None:  # the client read enough to drain it below its low mark
            super().resume_writing()
            self._resume_timer()

        def _resume_timer(self) -> None:
            if self._write_timer is not None:
                self._write_timer.cancel()
                self._write_timer = None

        def _write_stalled(self) -> None:
            self._write_timer = None
            logger.warning(
                "dropped a connection from %s: it read nothing of its response for %g s",
                f"{self.client[0]}:{self.client[1]}" if self.client else "a client",
                write_timeout_s,
            )
            self.transport.abort()  # connection_lost follows: the request sees the disconnect

        def _arm(self) -> None:
            self._header_timer = self.loop.call_later(timeout_s, self._headers_timed_out)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_timed_out(self) -> None:
            # Armed only while a request's headers are incomplete (disarmed when they complete).
            self._header_timer = None
            if not self.transport.is_closing():
                self.transport.close()

    return GuardedProtocol


def _json_error(status: bytes, message: str, code: str) -> bytes:
    """A whole HTTP response closing the connection: the OpenAI-style JSON error, written by the
    protocol itself (before any app sees the request)."""
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": code}
    body = json.dumps({"error": error}).encode()
    return (
        b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body
    )
