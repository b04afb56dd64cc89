"""Client processes: each runs one shard (an asyncio loop over its share of a fixed schedule).

Arrival times are fixed before the run and dealt round-robin to the processes, so together they
send exactly the planned schedule while each parses only 1/N of the streamed chunks. All processes
start on one wall-clock instant handed out once every one of them is ready (started, warm-up
requests answered, connections open). A single shard runs in the caller's process.

Worker processes are plain `python -c` subprocesses, not multiprocessing children: they import
the bench modules under a bare `nori_jax` package stub, so a client process never imports the
engine (JAX: seconds per process) whatever `nori_jax/__init__.py` pulls in, nor re-runs the
parent's `__main__` (as `spawn` does), and nothing is forked from a process holding threads.
Messages are pickles over the worker's stdin/stdout. Whatever happens in a worker (a crash, a
hang), the run ends and every request has a result with a reason.
"""

from __future__ import annotations

import asyncio
import math
import os
import pickle
import queue
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from nori_jax.bench.shard import ShardOutcome, ShardSpec, run_shard
from nori_jax.bench.stream_request import RequestResult

_PROGRESS_PERIOD_S = 0.1
_START_MARGIN_S = 0.05  # time for the start instant to reach every process before it passes
_SPAWN_GRACE_S = 60.0  # an interpreter importing asyncio and the bench, on a loaded machine

_BOOTSTRAP = (
    "import sys, types\n"
    "pkg = types.ModuleType('nori_jax')\n"
    "pkg.__path__ = [sys.argv[1]]\n"
    "sys.modules['nori_jax'] = pkg\n"
    "from nori_jax.bench.driver import worker_main\n"
    "worker_main()\n"
)


def run_shards(
    specs: list[ShardSpec], progress: Callable[[int], None] | None = None
) -> list[ShardOutcome]:
    """Run every shard to the end; one shard runs here, more in worker processes."""
    report = progress or (lambda n: None)
    if len(specs) == 1:
        return [asyncio.run(run_shard(specs[0], _start_soon, report))]
    return _run_processes(specs, report)


async def _start_soon() -> float:
    return time.time() + 0.001


def worker_main() -> None:
    """Entry point of a worker process: spec in, then 'ready', start time in, results out."""
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # stray prints go to stderr, never into the message stream
    sys.stdout = sys.stderr
    inp = sys.stdin.buffer
    lock = threading.Lock()

    def send(kind: str, payload: Any) -> None:
        with lock:
            pickle.dump((kind, payload), out, protocol=pickle.HIGHEST_PROTOCOL)
            out.flush()

    pending = 0

    def progress(n: int) -> None:
        nonlocal pending
        pending += n

    async def get_start() -> float:
        send("ready", None)
        return await asyncio.to_thread(pickle.load, inp)

    async def main(spec: ShardSpec) -> ShardOutcome:
        async def flush_progress() -> None:
            nonlocal pending
            while True:
                await asyncio.sleep(_PROGRESS_PERIOD_S)
                if pending > 0:
                    send("progress", pending)
                    pending = 0

        flusher = asyncio.create_task(flush_progress())
        try:
            return await run_shard(spec, get_start, progress)
        finally:
            flusher.cancel()

    try:
        send("result", asyncio.run(main(pickle.load(inp))))
    except BaseException:  # report, then exit: the parent fails this shard's requests
        send("error", traceback.format_exc(limit=5))


def _run_processes(specs: list[ShardSpec], progress: Callable[[int], None]) -> list[ShardOutcome]:
    pkg_dir = str(Path(__file__).resolve().parents[1])
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _BOOTSTRAP, pkg_dir],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        for _ in specs
    ]
    inbox: queue.Queue[tuple[str, int, Any]] = queue.Queue()
    for wid, proc in enumerate(procs):
        threading.Thread(target=_pump, args=(wid, proc.stdout, inbox), daemon=True).start()
    outcomes: dict[int, ShardOutcome] = {}
    errors: dict[int, str] = {}
    ready: set[int] = set()
    try:
        for wid, (spec, proc) in enumerate(zip(specs, procs, strict=True)):
            if not _write(proc, spec):
                errors[wid] = f"client process exited at start (code {proc.poll()})"
        ready_deadline = time.monotonic() + _SPAWN_GRACE_S + max(_warmup_bound(s) for s in specs)
        while len(ready) + len(errors) < len(specs) and time.monotonic() < ready_deadline:
            _receive(inbox, procs, ready, outcomes, errors, progress)
        start = time.time() + _START_MARGIN_S
        for wid in sorted(ready - errors.keys()):
            if not _write(procs[wid], start):
                errors[wid] = f"client process exited before the start (code {procs[wid].poll()})"
        run_deadline = time.monotonic() + _START_MARGIN_S + max(_run_bound(s) for s in specs)
        while len(outcomes) + len(errors) < len(specs) and time.monotonic() < run_deadline:
            _receive(inbox, procs, ready, outcomes, errors, progress)
    finally:
        for proc in procs:
            _stop(proc)
    return [
        outcomes[wid] if wid in outcomes else _failed_shard(spec, errors.get(wid, _LATE))
        for wid, spec in enumerate(specs)
    ]


_LATE = "client process did not finish in time"


def _pump(wid: int, stream: IO[bytes], inbox: queue.Queue[tuple[str, int, Any]]) -> None:
    """Reader thread: one worker's messages into the shared inbox, then 'eof'."""
    try:
        while True:
            kind, payload = pickle.load(stream)
            inbox.put((kind, wid, payload))
    except Exception:  # EOF (the process ended) or a torn message (it died writing)
        inbox.put(("eof", wid, None))


def _write(proc: subprocess.Popen[bytes], obj: Any) -> bool:
    assert proc.stdin is not None
    try:
        pickle.dump(obj, proc.stdin, protocol=pickle.HIGHEST_PROTOCOL)
        proc.stdin.flush()
    except (BrokenPipeError, OSError):
        return False
    return True


def _receive(
    inbox: queue.Queue[tuple[str, int, Any]],
    procs: list[subprocess.Popen[bytes]],
    ready: set[int],
    outcomes: dict[int, ShardOutcome],
    errors: dict[int, str],
    progress: Callable[[int], None],
) -> None:
    try:
        kind, wid, payload = inbox.get(timeout=_PROGRESS_PERIOD_S)
    except queue.Empty:
        return
    if kind == "ready":
        ready.add(wid)
    elif kind == "progress":
        progress(payload)
    elif kind == "result":
        outcomes[wid] = payload
    elif kind == "error":
        errors[wid] = f"client process crashed: {payload.strip().splitlines()[-1]}"
    elif wid not in outcomes and wid not in errors:  # eof without a result
        try:
            code = procs[wid].wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            code = None
        errors[wid] = f"client process exited with code {code}"


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.stdin is not None:
        try:
            proc.stdin.close()
        except OSError:
            pass
    try:
        proc.wait(timeout=1.0)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


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
