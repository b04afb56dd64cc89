"""Client processes: each runs one shard of the schedule (client.py), so the client is never the
bottleneck.

Arrival times are fixed before the run and dealt round-robin to the processes: together they send
exactly the planned schedule while each parses 1/N of the streamed chunks. All start on one
wall-clock instant handed out once every one is ready (started, warm-up answered).

Workers are `python -m nori_jax.bench.workers` subprocesses, not multiprocessing children, so they
never re-run the parent's `__main__` (as `spawn` does) nor fork a process that holds threads.
Messages are pickles over the worker's stdin and stdout. Whatever happens in a worker (a crash, a
hang) the run ends, and every request has a result with a reason. Ctrl-C reaches the parent only
(workers run in their own process group); the parent tells the workers to stop, and they return
what they have.
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

from nori_jax.bench.client import RequestResult, ShardOutcome, ShardSpec, run_shard

_POLL_S = 0.1
_START_MARGIN_S = 0.05  # time for the start instant to reach every process before it passes
_SPAWN_GRACE_S = 60.0  # an interpreter importing asyncio and aiohttp on a loaded machine
_STOP_GRACE_S = 10.0  # after Ctrl-C: for the workers to cancel and send what they have
STOP = "stop"


def run_workers(
    specs: list[ShardSpec],
    progress: Callable[[int], None],
    on_ready: Callable[[], None] | None = None,
) -> tuple[list[ShardOutcome], bool]:
    """Every shard's outcome, in order, and whether Ctrl-C cut the run short. `on_ready` runs
    once every process is ready (warm-up answered), just before the start instant is set."""
    root = str(Path(__file__).resolve().parents[2])  # this checkout, whatever sys.path says
    path = [root, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = os.environ | {"PYTHONPATH": os.pathsep.join(path)}
    procs = [  # a process group of their own: a terminal's Ctrl-C reaches only the parent
        subprocess.Popen(
            [sys.executable, "-m", "nori_jax.bench.workers"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            process_group=0,
        )
        for _ in specs
    ]
    inbox: queue.Queue[tuple[str, int, Any]] = queue.Queue()
    for wid, proc in enumerate(procs):
        threading.Thread(target=_pump, args=(wid, proc.stdout, inbox), daemon=True).start()
    ready: set[int] = set()
    outcomes: dict[int, ShardOutcome] = {}
    errors: dict[int, str] = {}

    def receive_until(done: Callable[[], bool], deadline: float) -> None:
        while not done() and time.monotonic() < deadline:
            try:
                kind, wid, payload = inbox.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if kind == "ready":
                ready.add(wid)
            elif kind == "progress":
                progress(payload)
            elif kind == "result":
                outcomes[wid] = payload
            elif kind == "error":
                errors.setdefault(wid, f"client process crashed: {payload}")
            elif wid not in outcomes:  # eof without a result
                errors.setdefault(wid, f"client process exited with code {_wait(procs[wid])}")

    finished = lambda: len(outcomes.keys() | errors.keys()) == len(specs)  # noqa: E731
    interrupted = False
    try:
        try:
            for wid, spec in enumerate(specs):
                if not _write(procs[wid], spec):
                    errors[wid] = f"client process exited at start (code {procs[wid].poll()})"
            warm = max(_wait_bound(len(s.warmup), s) for s in specs)
            deadline = time.monotonic() + _SPAWN_GRACE_S + warm
            receive_until(lambda: len(ready | errors.keys()) == len(specs), deadline)
            if on_ready is not None:
                on_ready()
            start = time.time() + _START_MARGIN_S
            for wid in sorted(ready - errors.keys()):
                if not _write(procs[wid], start):
                    errors[wid] = (
                        f"client process exited before the start (code {_wait(procs[wid])})"
                    )
            receive_until(finished, time.monotonic() + _START_MARGIN_S + max(map(_bound, specs)))
        except KeyboardInterrupt:
            interrupted = True
            for proc in procs:
                _write(proc, STOP)
            receive_until(finished, time.monotonic() + _STOP_GRACE_S)
    finally:
        for proc in procs:
            _stop(proc)
    late = "client process did not finish in time"
    return [
        outcomes[wid]
        if wid in outcomes
        else _failed_shard(spec, "interrupted" if interrupted else errors.get(wid, late))
        for wid, spec in enumerate(specs)
    ], interrupted


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
    except (BrokenPipeError, OSError, ValueError):  # ValueError: already closed
        return False
    return True


def _wait(proc: subprocess.Popen[bytes]) -> int | None:
    try:
        return proc.wait(timeout=5.0)
    except subprocess.TimeoutExpired:
        return None


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


def _wait_bound(num: int, spec: ShardSpec) -> float:
    """How long `num` requests of this shard can take: waves of its concurrency, each at most
    the timeout (inf without one). No requests take no time (never 0 x inf, which is NaN)."""
    if num == 0:
        return 0.0
    if spec.timeout_s is None:
        return math.inf
    return _waves(num, spec.concurrency) * spec.timeout_s


def _bound(spec: ShardSpec) -> float:
    """No request outlives its timeout, so this bounds a shard that is still healthy."""
    last_arrival = max((r.arrival_s for r in spec.requests), default=0.0)
    return last_arrival + _wait_bound(len(spec.requests), spec) + 30.0


def _failed_shard(spec: ShardSpec, reason: str) -> ShardOutcome:
    results = [RequestResult(r.index, r.arrival_s, error=reason) for r in spec.requests]
    return ShardOutcome(results, [], 0.0, [reason] * len(spec.warmup))


def worker_main() -> None:
    """A worker: spec in, 'ready' out, start instant in, result out; 'stop' or EOF ends it."""
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # stray prints go to stderr, never into the message stream
    sys.stdout = sys.stderr
    inp, lock = sys.stdin.buffer, threading.Lock()

    def send(kind: str, payload: Any = None) -> None:
        with lock:
            pickle.dump((kind, payload), out, protocol=pickle.HIGHEST_PROTOCOL)
            out.flush()

    async def main(spec: ShardSpec) -> ShardOutcome:
        loop = asyncio.get_running_loop()
        start: asyncio.Future[float | None] = loop.create_future()
        stop = asyncio.Event()

        def on_message(msg: Any) -> None:
            if isinstance(msg, float) and not start.done():
                start.set_result(msg)
            elif msg == STOP:
                stop.set()
                if not start.done():
                    start.set_result(None)

        threading.Thread(target=listen, args=(inp, loop, on_message), daemon=True).start()

        async def ready_then_start() -> float | None:
            send("ready")
            return await start

        return await run_shard(spec, ready_then_start, stop, lambda n: send("progress", n))

    try:
        send("result", asyncio.run(main(pickle.load(inp))))
    except BaseException as e:  # report, then exit: the parent fails this shard's requests
        traceback.print_exc(limit=5)  # the whole story, on stderr
        send("error", crash_reason(e))
    os._exit(0)  # not a normal shutdown: the listening thread still holds stdin's lock


def listen(
    inp: IO[bytes], loop: asyncio.AbstractEventLoop, on_message: Callable[[Any], None]
) -> None:
    """Thread: hands the parent's messages (the start instant, then a stop; EOF is a stop too)
    to the loop. Ends once the loop is closed: the parent closing stdin after the result is
    routine, not an error to print."""
    while True:
        try:
            msg = pickle.load(inp)
        except Exception:
            msg = STOP
        try:
            loop.call_soon_threadsafe(on_message, msg)
        except RuntimeError:  # "Event loop is closed": the run is over, nobody is listening
            return
        if msg == STOP:
            return


def crash_reason(e: BaseException) -> str:
    """The innermost exception, one line: a TaskGroup wraps the one that mattered in an
    ExceptionGroup, whose own text (or the last line of its rendering) says nothing."""
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    return " ".join(line.strip() for line in traceback.format_exception_only(e)).strip()


if __name__ == "__main__":
    worker_main()
