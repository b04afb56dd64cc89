"""Client processes: each runs an asyncio + httpx loop over its share of a fixed schedule.

Arrival times are fixed before the run and dealt round-robin to the processes, so together they
send exactly the planned schedule while each parses only 1/N of the streamed chunks. All processes
start on one wall-clock instant handed out after every one of them is ready (imports done,
warm-up requests answered, connections open). One process runs in the caller's process, with no
spawn cost. Whatever happens in a process (a crash, a hang), the run ends and every request has a
result: a process that does not answer in time has its requests failed with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import multiprocessing as mp
import queue as queue_lib
import time
import traceback
from collections.abc import Awaitable, Callable
from multiprocessing.connection import Connection

import httpx

from nori_jax.bench.config import EndpointKind
from nori_jax.bench.stream_request import RequestResult, WireRequest, send_request

_LOOP_PROBE_S = 0.005  # event-loop lag probe period
_PROGRESS_PERIOD_S = 0.1
_START_MARGIN_S = 0.05  # time for the start instant to reach every process before it passes
_SPAWN_GRACE_S = 120.0  # a fresh interpreter importing httpx, on a loaded machine


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


def run_shards(
    specs: list[ShardSpec], progress: Callable[[int], None] | None = None
) -> list[ShardOutcome]:
    """Run every shard to the end; one shard runs here, more in spawned processes."""
    report = progress or (lambda n: None)
    if len(specs) == 1:
        return [asyncio.run(run_shard(specs[0], _start_soon, report))]
    return _run_processes(specs, report)


async def _start_soon() -> float:
    return time.time() + 0.001


async def run_shard(
    spec: ShardSpec,
    get_start: Callable[[], Awaitable[float]],
    progress: Callable[[int], None],
) -> ShardOutcome:
    slots = asyncio.Semaphore(spec.concurrency) if spec.concurrency else None
    # httpx caps a pool at 100 connections and 20 idle ones by default: beyond that requests
    # would wait inside the client, invisible, and count as server latency.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    # trust_env=False: a proxy from the environment must not sit between client and server.
    async with httpx.AsyncClient(limits=limits, timeout=None, trust_env=False) as client:

        async def one(
            req: WireRequest, t0: float, dispatched: float, counted: bool = True
        ) -> RequestResult:
            result = RequestResult(req.index, req.arrival_s, dispatched_s=dispatched)
            async with slots or contextlib.nullcontext():
                await send_request(
                    client, spec.url, spec.headers, req, spec.endpoint, spec.timeout_s, t0, result
                )
            if counted:
                progress(1)
            return result

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


def _worker_main(wid: int, spec: ShardSpec, out: mp.Queue, start_conn: Connection) -> None:
    """Entry point of a spawned client process."""
    pending = 0

    def progress(n: int) -> None:
        nonlocal pending
        pending += n

    async def get_start() -> float:
        out.put(("ready", wid, None))
        return await asyncio.to_thread(start_conn.recv)

    async def main() -> ShardOutcome:
        async def flush_progress() -> None:
            nonlocal pending
            while True:
                await asyncio.sleep(_PROGRESS_PERIOD_S)
                if pending > 0:
                    out.put(("progress", wid, pending))
                    pending = 0

        flusher = asyncio.create_task(flush_progress())
        try:
            return await run_shard(spec, get_start, progress)
        finally:
            flusher.cancel()

    try:
        outcome = asyncio.run(main())
        out.put(("result", wid, outcome))
    except BaseException:  # report, then exit: the parent fails this shard's requests
        out.put(("error", wid, traceback.format_exc(limit=5)))


def _run_processes(specs: list[ShardSpec], progress: Callable[[int], None]) -> list[ShardOutcome]:
    ctx = mp.get_context("spawn")  # fork is unsafe next to threads (a server, tqdm's monitor)
    out: mp.Queue = ctx.Queue()
    procs, start_ends = [], []
    for wid, spec in enumerate(specs):
        recv_end, send_end = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_worker_main, args=(wid, spec, out, recv_end), daemon=True)
        proc.start()
        procs.append(proc)
        start_ends.append(send_end)
    outcomes: dict[int, ShardOutcome] = {}
    errors: dict[int, str] = {}
    try:
        ready_deadline = time.monotonic() + _SPAWN_GRACE_S + max(_warmup_bound(s) for s in specs)
        ready: set[int] = set()
        while len(ready) + len(errors) < len(specs) and time.monotonic() < ready_deadline:
            _receive(out, procs, ready, outcomes, errors, progress)
        start = time.time() + _START_MARGIN_S
        for wid in ready:
            start_ends[wid].send(start)
        run_deadline = time.monotonic() + _START_MARGIN_S + max(_run_bound(s) for s in specs)
        while len(outcomes) + len(errors) < len(specs) and time.monotonic() < run_deadline:
            _receive(out, procs, ready, outcomes, errors, progress)
    finally:
        for proc in procs:
            proc.join(timeout=1.0)
            if proc.is_alive():
                proc.terminate()
    return [
        outcomes[wid] if wid in outcomes else _failed_shard(spec, errors.get(wid, "no answer"))
        for wid, spec in enumerate(specs)
    ]


def _receive(
    out: mp.Queue,
    procs: list,
    ready: set[int],
    outcomes: dict[int, ShardOutcome],
    errors: dict[int, str],
    progress: Callable[[int], None],
) -> None:
    try:
        kind, wid, payload = out.get(timeout=_PROGRESS_PERIOD_S)
    except queue_lib.Empty:
        for wid, proc in enumerate(procs):  # a process that died silently (killed, segfault)
            if wid not in outcomes and wid not in errors and proc.exitcode is not None:
                time.sleep(_PROGRESS_PERIOD_S)  # its last message may still be in the pipe
                if out.empty():
                    errors[wid] = f"client process exited with code {proc.exitcode}"
        return
    if kind == "ready":
        ready.add(wid)
    elif kind == "progress":
        progress(payload)
    elif kind == "result":
        outcomes[wid] = payload
    else:
        errors[wid] = f"client process crashed: {payload.strip().splitlines()[-1]}"


def _waves(num: int, concurrency: int | None) -> int:
    return math.ceil(num / concurrency) if concurrency and num else min(num, 1)


def _warmup_bound(spec: ShardSpec) -> float:
    return _waves(len(spec.warmup), spec.concurrency) * spec.timeout_s


def _run_bound(spec: ShardSpec) -> float:
    """No request outlives its timeout, so this bounds a shard that is still healthy."""
    last_arrival = max((r.arrival_s for r in spec.requests), default=0.0)
    return last_arrival + _waves(len(spec.requests), spec.concurrency) * spec.timeout_s + 30.0


def _failed_shard(spec: ShardSpec, reason: str) -> ShardOutcome:
    results = [
        RequestResult(r.index, r.arrival_s, success=False, error=reason) for r in spec.requests
    ]
    return ShardOutcome(results, [], 0.0, warmup_failed=len(spec.warmup), warmup_error=reason)
