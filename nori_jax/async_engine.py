"""AsyncEngine: an LLMEngine stepped by its own thread, with results handed to asyncio.

The engine thread owns the engine and so every JAX call; asyncio code never touches it. Callers
send it commands (add, abort, stop) through a thread-safe queue, and each request gets its own
`RequestStream`, an asyncio queue the thread fills once per step. This is the library's async
API; the HTTP server (serve/) is a thin layer over it.

    engine = AsyncEngine(LLMEngine(config))
    engine.start()
    async for out in engine.generate("Hello", SamplingParams(max_tokens=8)):
        print(out.new_text, end="")

A request the engine fails alone (its settings could not enter the step's arrays, or handling its
outputs raised: finish reason "error") ends with a `RequestFailedError`; the others go on. If the
loop itself dies (an exception in `step()` that no request is to blame for), every request in
flight gets an `EngineDeadError`, new requests an `EngineStoppedError`, and `is_healthy` turns
False for good (the engine-core process of `nori-jax serve` is restarted instead: core_client.py).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from nori_jax.client_base import StreamingClient, check_timeout
from nori_jax.core.outputs import RequestOutput
from nori_jax.heap_freeze import heap_frozen
from nori_jax.sampling_params import SamplingParams
from nori_jax.weight_control import run_control

if TYPE_CHECKING:
    from nori_jax.engine import LLMEngine

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop died while this request was in flight."""


class EngineStoppedError(RuntimeError):
    """The engine takes no new requests: it is shutting down, or its loop has died."""


class RequestTimeoutError(TimeoutError):
    """The request ran past its deadline and was aborted."""


class RequestFailedError(RuntimeError):
    """The engine failed this request alone (finish reason "error"); the others went on."""


def request_failed(out: RequestOutput) -> RequestFailedError:
    """The error of a finished output whose finish reason is "error"."""
    return RequestFailedError(f"request {out.request_id} failed in the engine: {out.error}")


@dataclasses.dataclass
class _Add:
    stream: RequestStream
    prompt: str | list[int]
    params: SamplingParams
    arrival_time: float
    future: concurrent.futures.Future[None]
    stream_outputs: bool = True
    priority: int = 0


@dataclasses.dataclass
class _Control:
    op: str
    level: int
    model_path: str | None
    future: concurrent.futures.Future[bool]


class RequestStream:
    """One request's outputs, in step order, ending with the one whose `finished` is True.

    A consumer that falls behind the engine gets the outputs waiting for it merged into one (their
    `new_token_ids` and `new_text` joined), as vLLM does: a slow client then costs one event per
    read, not one per step. Iterating raises EngineDeadError if the loop dies, and
    RequestTimeoutError (after aborting the request) once the deadline passes. A consumer that
    stops early must call `abort()`, so the request's KV pages go back to the pool;
    `AsyncEngine.generate` does that for you.
    """

    def __init__(self, request_id: str, engine: AsyncEngine, deadline: float | None):
        self.request_id = request_id
        self._engine = engine
        self._loop = asyncio.get_running_loop()
        # Touched on the event loop only (the engine thread hands items over with
        # call_soon_threadsafe), so no lock.
        self._items: collections.deque[RequestOutput | BaseException] = collections.deque()
        self._ready = asyncio.Event()
        self._deadline = deadline  # on the event loop's clock
        self._timeout_s: float | None = None
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            async with asyncio.timeout_at(self._deadline):
                while not self._items:
                    self._ready.clear()
                    await self._ready.wait()
        except TimeoutError:
            self.abort()
            raise RequestTimeoutError(
                f"request {self.request_id} did not finish within {self._timeout_s:g} s"
            ) from None
        item = self._items.popleft()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        while self._items and isinstance(self._items[0], RequestOutput) and not item.finished:
            # The later output takes the earlier one's deltas in front of its own, in place: each
            # output belongs to this stream alone (dataclasses.replace cost the server a tenth of
            # its CPU once streams fell behind).
            later = self._items.popleft()
            later.new_token_ids = item.new_token_ids + later.new_token_ids
            later.new_text = item.new_text + later.new_text
            if later.new_logprobs is not None:
                later.new_logprobs = (item.new_logprobs or []) + later.new_logprobs
            if later.new_top_logprobs is not None:
                later.new_top_logprobs = (item.new_top_logprobs or []) + later.new_top_logprobs
            item = later
        self.finished = item.finished
        return item

    async def result(self) -> RequestOutput:
        """Wait for the final output (full text and token ids); aborts if cancelled."""
        try:
            async for out in self:
                if out.finished:
                    return out
        finally:
            self.abort()
        raise AssertionError("a stream ends with a finished output")

    def abort(self) -> None:
        """Stop generating (idempotent); the pages are freed before the engine's next step."""
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)

    def _put(self, item: RequestOutput | BaseException) -> None:  # on the event loop
        self._items.append(item)
        self._ready.set()


class AsyncEngine(StreamingClient):
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._thread: threading.Thread | None = None
        # Guards the accept/dead/stopping transitions against add(), so no command is queued
        # after the thread has stopped reading them.
        self._lock = threading.Lock()
        self._accepting = False
        self._dead: BaseException | None = None
        self._stop_requested = False

    # ---- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread; the engine is already compiled, so it serves at once."""
        if self._thread is not None:
            raise RuntimeError("AsyncEngine already started")
        self._accepting = True
        self._thread = threading.Thread(target=self._run, name="nori-engine", daemon=True)
        self._thread.start()

    @property
    def is_started(self) -> bool:
        return self._thread is not None

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def metrics(self):
        """The engine's metrics (read without stopping it; gauges as of the last step)."""
        return self.engine.metrics

    @property
    def is_healthy(self) -> bool:
        """True while the loop runs and takes new requests."""
        t = self._thread
        return t is not None and t.is_alive() and self._accepting and self._dead is None

    @property
    def dead_reason(self) -> str | None:
        return None if self._dead is None else f"{type(self._dead).__name__}: {self._dead}"

    def _refusal(self) -> str:
        if self._dead is not None:
            return f"the engine loop has died ({self.dead_reason})"
        return (
            "the engine is not started" if self._thread is None else "the engine is shutting down"
        )

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    async def shutdown(self, drain_timeout_s: float | None = None) -> None:
        """Refuse new requests, let those in flight finish (up to the timeout), stop the thread.

        Requests still running after the timeout end with EngineStoppedError.
        """
        with self._lock:
            self._accepting = False
        deadline = None if drain_timeout_s is None else time.monotonic() + drain_timeout_s
        # Adds already queued count as in flight: they were accepted before the refusal.
        while (self._streams or not self._commands.empty()) and self._dead is None:
            if deadline is not None and time.monotonic() >= deadline:
                logger.warning(
                    "drain timeout: stopping with %d requests in flight", len(self._streams)
                )
                break
            await asyncio.sleep(0.02)
        await asyncio.to_thread(self.stop)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the thread now (no draining); requests in flight end with EngineStoppedError."""
        with self._lock:
            self._accepting = False
            self._stop_requested = True
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    # ---- requests ---------------------------------------------------------------------------

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Validate and encode a prompt on the caller's thread (the tokenizer is thread-safe)."""
        return self.engine.tokenize(prompt)[0]

    async def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        timeout_s: float | None = None,
        stream: bool = True,
        priority: int = 0,
    ) -> RequestStream:
        """Queue a request; returns once the engine has accepted it.

        Raises ValueError (bad input), QueueFullError (waiting queue full), EngineStoppedError.
        `timeout_s` bounds the whole request, queueing included. Without `stream` the stream
        yields only the finished output. `priority`: under the scheduling policy "priority", lower
        runs first (0 under "fcfs").
        """
        check_timeout(timeout_s)
        arrival = time.monotonic()
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        out_stream = RequestStream(request_id or f"req-{uuid.uuid4().hex}", self, deadline)
        out_stream._timeout_s = timeout_s
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        with self._lock:
            if not self._accepting:
                raise EngineStoppedError(self._refusal())
            self._commands.put(_Add(out_stream, prompt, params, arrival, future, stream, priority))
        self._wake.set()
        try:
            await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            out_stream.abort()  # accepted or not: an abort of an unknown id is a no-op
            raise
        return out_stream

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread; a no-op for unknown or finished requests."""
        self._commands.put(("abort", request_id))
        self._wake.set()

    async def control(self, op: str, level: int = 1, model_path: str | None = None) -> bool:
        """A weight operation on the engine thread, between steps (weight_control.run_control:
        "sleep", "wake_up", "update_weights", "is_sleeping"); whether the engine sleeps after
        it. Raises what the operation raises; EngineStoppedError once stopping."""
        future: concurrent.futures.Future[bool] = concurrent.futures.Future()
        with self._lock:
            if not self._accepting:
                raise EngineStoppedError(self._refusal())
            self._commands.put(_Control(op, level, model_path, future))
        self._wake.set()
        return await asyncio.wrap_future(future)

    # ---- the engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            with heap_frozen():  # for the loop's life: see heap_freeze.py
                self._loop()
        except BaseException as e:  # noqa: BLE001 - whatever kills the loop must fail every request
            logger.exception("engine loop died")
            self._die(e)
            return
        for request_id in list(self._streams):
            self.engine.abort(request_id)  # leave the engine clean for whoever uses it next
        self._fail_all(lambda: EngineStoppedError("the engine was stopped"))

    def _loop(self) -> None:
        while True:
            self._apply_commands()
            if self._stop_requested:
                return
            if not self.engine.has_unfinished_requests():
                # Going idle: finish the step still in flight, bring the gauges up to date
                # (aborts happen between steps), then sleep until a command arrives.
                self._deliver(self.engine.drain())
                self.engine.get_metrics()
                self._wake.wait()
                self._wake.clear()
                continue
            self._deliver(self.engine.step())

    def _apply_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Add):
                self._add(cmd)
            elif isinstance(cmd, _Control):
                self._control(cmd)
            else:
                _, request_id = cmd
                out = self.engine.abort(request_id)
                if out is not None:
                    self._deliver([out])

    def _add(self, cmd: _Add) -> None:
        if not cmd.future.set_running_or_notify_cancel():
            return  # the caller gave up before the engine got to it
        try:
            self.engine.add_request(
                cmd.stream.request_id,
                cmd.prompt,
                cmd.params,
                cmd.arrival_time,
                stream=cmd.stream_outputs,
                priority=cmd.priority,
            )
        except Exception as e:  # bad input, full queue: the caller's error, never the loop's
            cmd.future.set_exception(e)
            return
        self._streams[cmd.stream.request_id] = cmd.stream
        cmd.future.set_result(None)

    def _control(self, cmd: _Control) -> None:
        if not cmd.future.set_running_or_notify_cancel():
            return
        try:
            if not self.engine.has_unfinished_requests():
                self._deliver(self.engine.drain())  # the last step's tokens go to their streams
            result = run_control(self.engine.weight_control, cmd.op, cmd.level, cmd.model_path)
        except Exception as e:  # noqa: BLE001 - the caller's answer, never the loop's end
            cmd.future.set_exception(e)
            return
        cmd.future.set_result(result)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        deliver(self._streams, outputs)

    def _die(self, exc: BaseException) -> None:
        with self._lock:
            self._dead = exc
            self._accepting = False
        reason = self.dead_reason
        self._fail_all(lambda: EngineDeadError(f"the engine loop died: {reason}"))

    def _fail_all(self, make_error: Callable[[], BaseException]) -> None:
        """End every request in flight, and every add still queued, with a fresh error each."""
        with self._lock:
            self._accepting = False
            pending = []
            while True:
                try:
                    pending.append(self._commands.get_nowait())
                except queue.Empty:
                    break
        for cmd in pending:
            if isinstance(cmd, (_Add, _Control)) and not cmd.future.done():
                cmd.future.set_exception(make_error())
        streams, self._streams = list(self._streams.values()), {}
        fail_streams(streams, make_error)


def deliver(
    streams: dict[str, RequestStream],
    outputs: list[RequestOutput],
    lock: threading.Lock | None = None,
) -> None:
    """Hand a step's outputs to their streams: one wake-up of each event loop per step. A
    stream's entry goes with its finished output."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, Any]]] = {}
    with lock or contextlib.nullcontext():
        for out in outputs:
            stream = streams.get(out.request_id)
            if stream is None:
                continue
            item: RequestOutput | BaseException = out
            if out.finished:
                del streams[out.request_id]
                if out.finish_reason == "error":
                    item = request_failed(out)
            by_loop.setdefault(stream._loop, []).append((stream, item))
    for loop, items in by_loop.items():
        _call_soon(loop, _put_all, items)


def fail_streams(streams: list[RequestStream], make_error: Callable[[], BaseException]) -> None:
    """End each stream with a fresh error."""
    for stream in streams:
        _call_soon(stream._loop, stream._put, make_error())


def _put_all(items: list[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
    for stream, out in items:
        stream._put(out)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass  # that event loop is closed: nobody is waiting for these outputs any more
