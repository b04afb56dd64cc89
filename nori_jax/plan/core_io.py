"""The engine-core process's work around each step, which the step's own time leaves out.

Served, the core's loop (`engine_core_process._serve`) takes the requests that arrived off its
socket and, after the step, splits the step's outputs by API server, encodes one message each and
sends them. That is host time between two steps, per loop iteration:

    io_s = step_s + row_s * rows delivered by the step

(the engine reports it as `nori:engine_core_io_seconds`; `bench serve` as "io ms" per step).
`measure` times the real send path (`_Clients.send_step`: split, msgpack, ZeroMQ) on this host
with sockets bound in this process, for a number of API servers; `plan calibrate` records it for
1 and 4 of them beside the step-time model, and the simulator advances its host clock by it after
every step. The arrivals' part (decoding a request and queueing it) is left out: the simulated
core queues its requests at no cost, and at the rates served here that is a request or two per
step, tens of microseconds.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import tempfile
import time
from collections.abc import Sequence

import numpy as np

from nori_jax.socket_dirs import socket_root

MEASURED_API_SERVERS = (1, 4, 8)  # API server counts: one, the suites' four, eight
_STAGE_TIMES = (0.001, 0.01, 0.8, 0.011, 0.81)  # queue, prefill, decode, TTFT, E2E: any floats


@dataclasses.dataclass(frozen=True)
class CoreIO:
    step_s: float = 0.0  # per loop iteration that ran or delivered a step
    row_s: float = 0.0  # per row (token) the step delivered

    def __post_init__(self) -> None:
        for name in ("step_s", "row_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"core I/O {name}={v} must be finite and >= 0")

    def seconds(self, rows: int) -> float:
        return self.step_s + self.row_s * rows

    @property
    def enabled(self) -> bool:
        return bool(self.step_s or self.row_s)


NO_CORE_IO = CoreIO()


def measure(
    api_servers: int, rows: Sequence[int] = (0, 64, 256, 1024), iterations: int = 200
) -> CoreIO:
    """Median time of `_Clients.send_step` over `iterations` steps of each row count, as a line
    through (rows, seconds): the step outputs of a served decode batch (every row a token of a
    distinct request, the requests spread over the API servers, one finish per 256 rows)."""
    import msgspec
    import zmq

    from nori_jax.core.outputs import EngineCoreOutputs, FinishedRequest, RequestMetrics, StepStats
    from nori_jax.engine_core_process import _Clients

    if api_servers < 1:
        raise ValueError(f"api_servers={api_servers} must be >= 1")
    ctx = zmq.Context()
    medians = []
    with tempfile.TemporaryDirectory(prefix="nori-core-io-", dir=socket_root()) as d:
        addrs = [f"ipc://{d}/out{i}" for i in range(api_servers)]
        sinks = []
        for addr in addrs:  # bound and never read: ZeroMQ's own threads take the messages in
            sink = ctx.socket(zmq.PULL)
            sink.setsockopt(zmq.RCVHWM, 0)
            sink.bind(addr)
            sinks.append(sink)
        clients = _Clients(ctx, addrs)
        for sock in clients.sockets:
            sock.setsockopt(zmq.SNDHWM, 0)
        encode = msgspec.msgpack.Encoder().encode
        metrics = RequestMetrics(*_STAGE_TIMES, 0, 0)
        try:
            for n in rows:
                ids = [f"cmpl-{i:032x}-0" for i in range(n)]
                for i, rid in enumerate(ids):
                    clients.owner[rid] = i % api_servers
                tokens = np.arange(n, dtype=np.int32).tobytes()
                finished = [FinishedRequest(rid, "length", 500, 200, metrics) for rid in ids[::256]]
                stats = StepStats(n, 0, 0.5, n, 0, 0, 0, 0, 0.0005, 0.004, 1)
                times = []
                answers: list[list] = [[] for _ in range(api_servers)]
                for _ in range(iterations):
                    out = EngineCoreOutputs(list(ids), tokens, b"", list(finished), [], stats, [])
                    t0 = time.perf_counter()
                    clients.send_step(out, answers, answers, encode)
                    times.append(time.perf_counter() - t0)
                    for i in range(0, n, 256):  # send_step forgot the finished ones' owners
                        clients.owner[ids[i]] = i % api_servers
                medians.append(statistics.median(times))
        finally:
            clients.close()
            for sink in sinks:
                sink.close(linger=0)
            ctx.term()
    slope, intercept = np.polyfit(np.asarray(rows, float), np.asarray(medians), 1)
    return CoreIO(max(0.0, float(intercept)), max(0.0, float(slope)))
