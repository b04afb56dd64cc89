"""uvicorn, with the server's shutdown contract and a header read timeout.

Shutdown (SIGTERM or Ctrl-C): the server keeps listening, so probes get an answer; `/health` and
new work answer 503 with a JSON body; requests in flight may finish within the drain timeout, and
those still running after it end with a JSON error (a stream: an error event, then its usual
end, `[DONE]` on SSE), never cut mid-chunk. Then uvicorn closes the listener and exits. A second
signal stops at once (uvicorn's own shutdown).

Header timeout: uvicorn bounds only the idle time between requests; a client that trickles its
request line and headers would hold a connection for ever. `header_timeout_protocol` closes a
connection whose headers are not complete within the timeout of its first byte (or of the
connection's start).
"""

from __future__ import annotations

import asyncio
import logging
import time
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from nori_jax.engine_client import EngineClient

if TYPE_CHECKING:
    from serve.api_servers import ApiServers

logger = logging.getLogger(__name__)


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


def header_timeout_protocol(timeout_s: float) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol (its C parser: a third less CPU per streamed event than the
    pure-Python h11 one, docs/benchmarks.md), closing connections whose request headers take over
    timeout_s."""

    class HeaderTimeoutProtocol(HttpToolsProtocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_message_begin(self) -> None:  # a request's first byte: its headers are due
            super().on_message_begin()
            if self._header_timer is None:
                self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

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

    return HeaderTimeoutProtocol
