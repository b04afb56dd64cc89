"""One client process's work: its share of the schedule, sent from one asyncio event loop.

Requests are created at their scheduled arrival times (never earlier, as early as the loop
allows), optionally limited by this process's share of --max-concurrency. The loop also measures
its own lag and CPU use, the evidence for "the client is the bottleneck" warnings.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Awaitable, Callable

from nori_jax.bench.config import EndpointKind
from nori_jax.bench.http1 import HttpClient
from nori_jax.bench.stream_request import RequestResult, WireRequest, send_request

_LOOP_PROBE_S = 0.005  # event-loop lag probe period


@dataclasses.dataclass(frozen=True)
class ShardSpec:
    url: str
    headers: dict[str, str]
    endpoint: EndpointKind
    timeout_s: float
    concurrency: int | None  # this process's share of --max-concurrency
    requests: list[WireRequest]
    warmup: list[WireRequest]


@dataclasses.dataclass
class ShardOutcome:
    results: list[RequestResult]
    loop_lags_s: list[float]  # how late each event-loop probe woke up
    cpu_util: float  # process CPU time / wall time over the run; ~1.0 means saturated
    warmup_failed: int = 0
    warmup_error: str = ""


async def run_shard(
    spec: ShardSpec,
    get_start: Callable[[], Awaitable[float]],
    progress: Callable[[int], None],
) -> ShardOutcome:
    slots = asyncio.Semaphore(spec.concurrency) if spec.concurrency else None
    client = HttpClient(spec.url, spec.headers)

    async def one(
        req: WireRequest, t0: float, dispatched: float, counted: bool = True
    ) -> RequestResult:
        result = RequestResult(req.index, req.arrival_s, dispatched_s=dispatched)
        async with slots or contextlib.nullcontext():
            await send_request(client, req, spec.endpoint, spec.timeout_s, t0, result)
        if counted:
            progress(1)
        return result

    try:
        now = time.perf_counter()
        warm = await asyncio.gather(*(one(r, now, 0.0, counted=False) for r in spec.warmup))
        failed_warm = [r for r in warm if not r.success]

        start_wall = await get_start()
        t0 = time.perf_counter() + (start_wall - time.time())
        lags: list[float] = []
        cpu0, wall0 = time.process_time(), time.perf_counter()
        watcher = asyncio.create_task(_watch_loop(lags, t0))
        tasks = []
        for req in spec.requests:
            delay = t0 + req.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(req, t0, time.perf_counter() - t0)))
        results = list(await asyncio.gather(*tasks))
        watcher.cancel()
        wall = time.perf_counter() - wall0
        cpu_util = (time.process_time() - cpu0) / wall if wall > 0 else 0.0
    finally:
        client.close()
    return ShardOutcome(
        results,
        lags,
        cpu_util,
        warmup_failed=len(failed_warm),
        warmup_error=failed_warm[0].error if failed_warm else "",
    )


async def _watch_loop(lags: list[float], t0: float) -> None:
    """Event-loop lag: a busy loop timestamps chunks late, which inflates ITL and TTFT."""
    await asyncio.sleep(max(0.0, t0 - time.perf_counter()))
    while True:
        before = time.perf_counter()
        await asyncio.sleep(_LOOP_PROBE_S)
        lags.append(time.perf_counter() - before - _LOOP_PROBE_S)
