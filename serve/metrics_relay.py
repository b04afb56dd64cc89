"""One /metrics for the whole server with several API server processes.

Every API server counts every step's finishes and stats, so each process's registry describes the
whole engine, but only since that process started: an API server restarted after a crash counts
from 0 while API server 0 (which lives as long as the server) does not, and a scraper on the port
reaches either (SO_REUSEPORT), so its counters would jump back and forth and `rate()` would read
garbage. So API servers 1.. answer /metrics with API server 0's exposition, fetched over a private
ipc socket (`MetricsPublisher` in API server 0, `fetch` in the others); where API server 0 does
not answer within FETCH_TIMEOUT_S, a process answers with its own registry and says so in the
`x-nori-metrics-source: local` header.
"""

from __future__ import annotations

import logging
import threading

import zmq
from prometheus_client import CollectorRegistry, generate_latest

logger = logging.getLogger(__name__)
FETCH_TIMEOUT_S = 2.0


def metrics_address(directory: str) -> str:
    """The socket API server 0 publishes its exposition on, in the API servers' directory."""
    return f"ipc://{directory}/metrics"


class MetricsPublisher:
    """API server 0's side: a thread answering each request on `address` with the registry's
    exposition."""

    def __init__(self, registry: CollectorRegistry, address: str):
        self._registry = registry
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(address)
        self._stopping = False
        self._thread = threading.Thread(target=self._serve, name="nori-metrics", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stopping:
            try:
                if not poller.poll(200):
                    continue
                self._sock.recv()
                self._sock.send(generate_latest(self._registry))
            except zmq.ZMQError:
                if self._stopping:
                    return
                logger.exception("metrics relay failed")
                return

    def close(self) -> None:
        self._stopping = True
        self._thread.join(2.0)
        self._sock.close()
        self._ctx.term()


def fetch(address: str, timeout_s: float = FETCH_TIMEOUT_S) -> bytes | None:
    """API server 0's exposition, or None if it did not answer in time (blocking: call it off
    the event loop). A socket per call: a REQ socket whose answer never came cannot ask again."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
    try:
        sock.connect(address)
        sock.send(b"")
        return sock.recv()
    except zmq.ZMQError:
        return None
    finally:
        sock.close()
