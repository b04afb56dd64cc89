"""EngineCoreClient: the engine core in its own process, behind the async engine API.

The API server's side of the process split (engine_core_process.py): it tokenizes and validates,
sends requests to the core, and turns the core's per-step outputs into `RequestOutput`s
(detokenization, stop strings) and metrics, in this process, off the step loop's GIL. It has the
same public API as `AsyncEngine` (the in-process thread), so the server and library users take
either:

    client = EngineCoreClient(EngineConfig.from_yaml("default"))   # starts and compiles the core
    client.start()                                                  # inside the event loop
    async for out in client.generate("Hello", SamplingParams(max_tokens=8)):
        print(out.new_text, end="")

A reader thread receives the core's messages, runs the output processor and hands each step's
outputs to the event loop in one call. If the core process dies, every request in flight gets an
EngineDeadError (a JSON error at the HTTP layer) and `is_healthy` turns False.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import numpy as np
import zmq

from nori_jax.async_engine import (
    EngineDeadError,
    EngineStoppedError,
    RequestStream,
    deliver,
    fail_streams,
)
from nori_jax.core.engine_core import EngineCoreRequest
from nori_jax.core.output_processor import OutputProcessor
from nori_jax.core.outputs import RequestOutput
from nori_jax.core.scheduler import QueueFullError
from nori_jax.engine_config import EngineConfig
from nori_jax.engine_core_process import (
    AbortRequests,
    AddRequests,
    CoreMessage,
    EngineInfo,
    Failed,
    Ready,
    Shutdown,
    StepMessage,
)
from nori_jax.metrics import EngineMetrics
from nori_jax.prompts import encode_prompt
from nori_jax.sampling_params import SamplingParams
from nori_jax.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class EngineCoreClient:
    def __init__(
        self, config: EngineConfig, *, startup_timeout_s: float | None = None, log_level=None
    ):
        self.config = config
        self._dir = tempfile.mkdtemp(prefix="nori-core-")
        self._zmq = zmq.Context()
        self._to_core = self._zmq.socket(zmq.PUSH)
        self._to_core.bind(f"ipc://{self._dir}/in")
        self._from_core = self._zmq.socket(zmq.PULL)
        self._from_core.bind(f"ipc://{self._dir}/out")
        self._send_lock = threading.Lock()
        self._encode = msgspec.msgpack.Encoder().encode
        self._decode = msgspec.msgpack.Decoder(CoreMessage).decode
        level = log_level or logging.getLevelName(logging.getLogger().getEffectiveLevel())
        # A fresh interpreter (not multiprocessing): JAX is not fork-safe, and spawn would run
        # the caller's main module again in the child.
        cmd = [sys.executable, "-m", "nori_jax.engine_core_process"]
        cmd += [f"ipc://{self._dir}/in", f"ipc://{self._dir}/out", level]
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE)
        self._proc.stdin.write(pickle.dumps(config))
        self._proc.stdin.close()
        self.info = self._wait_ready(startup_timeout_s)
        tok = self.info.tokenizer
        self.tokenizer: Tokenizer | None = Tokenizer.from_state(tok) if tok else None
        self.max_model_len = self.info.max_model_len
        self.metrics = EngineMetrics()
        self.metrics.set_model_config(self.info.model_config_info)
        self._processor = OutputProcessor(self.tokenizer)
        self._streams: dict[str, RequestStream] = {}  # guarded by _lock
        self._acks: dict[str, concurrent.futures.Future[None]] = {}
        self._lock = threading.Lock()
        self._accepting = False
        self._dead: str | None = None
        self._stopping = False
        self._reader: threading.Thread | None = None
        self._rng = np.random.default_rng(config.seed)

    def _wait_ready(self, timeout_s: float | None) -> EngineInfo:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            if self._from_core.poll(200):
                msg = self._decode(self._from_core.recv())
                if isinstance(msg, Ready):
                    return msg.info
                if isinstance(msg, Failed):
                    self._close()
                    raise RuntimeError(f"the engine core failed to start: {msg.reason}")
            if not self._alive():
                self._close()
                raise RuntimeError(
                    f"the engine core process exited during start-up (code {self._proc.returncode})"
                )
            if deadline is not None and time.monotonic() > deadline:
                self._proc.kill()
                self._close()
                raise RuntimeError(f"the engine core was not ready within {timeout_s} s")

    # ---- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        """Start reading the core's outputs; the core is compiled, so this serves at once."""
        if self._reader is not None:
            raise RuntimeError("EngineCoreClient already started")
        self._accepting = True
        self._reader = threading.Thread(target=self._read, name="nori-core-reader", daemon=True)
        self._reader.start()

    @property
    def is_started(self) -> bool:
        return self._reader is not None

    @property
    def is_healthy(self) -> bool:
        return self._accepting and self._dead is None and self._alive()

    @property
    def dead_reason(self) -> str | None:
        return self._dead

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def _alive(self) -> bool:
        return self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        """The engine-core process's id."""
        return self._proc.pid

    async def shutdown(self, drain_timeout_s: float | None = None) -> None:
        """Refuse new requests, let those in flight finish (up to the timeout), stop the core."""
        self._accepting = False
        deadline = None if drain_timeout_s is None else time.monotonic() + drain_timeout_s
        while self._streams and self._dead is None:
            if deadline is not None and time.monotonic() >= deadline:
                logger.warning(
                    "drain timeout: stopping with %d requests in flight", len(self._streams)
                )
                break
            await asyncio.sleep(0.02)
        await asyncio.to_thread(self.stop)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the core now; requests in flight end with EngineStoppedError."""
        self._accepting = False
        self._stopping = True
        if self._alive():
            self._send(Shutdown())
            try:
                self._proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(5)
        if self._dead is None:
            self._dead = "the engine was stopped"
        self._fail_all(lambda: EngineStoppedError("the engine was stopped"))
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(5)
        self._close()

    def _close(self) -> None:
        for sock in (self._to_core, self._from_core):
            sock.close(linger=0)
        self._zmq.term()

    # ---- requests ---------------------------------------------------------------------------

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Validate and encode a prompt (ValueError on bad input)."""
        return encode_prompt(self.tokenizer, prompt, self.info.vocab_size, self.max_model_len)[0]

    async def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        timeout_s: float | None = None,
        stream: bool = True,
    ) -> RequestStream:
        """Queue a request; returns once the core has accepted it.

        Raises ValueError (bad input), QueueFullError (waiting queue full), EngineStoppedError.
        `timeout_s` bounds the whole request, queueing included. Without `stream` the stream
        yields only the finished output.
        """
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s} must be > 0")
        params.validate()
        token_ids, text = encode_prompt(
            self.tokenizer, prompt, self.info.vocab_size, self.max_model_len
        )
        arrival = time.monotonic()
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        rid = request_id or f"req-{uuid.uuid4().hex}"
        seed = params.seed if params.seed is not None else int(self._rng.integers(0, 2**31))
        request = EngineCoreRequest(rid, token_ids, params, seed, self.info.eos_token_ids, arrival)
        out_stream = RequestStream(rid, self, deadline)
        out_stream._timeout_s = timeout_s
        ack: concurrent.futures.Future[None] = concurrent.futures.Future()
        with self._lock:
            if not self._accepting or self._dead is not None:
                raise EngineStoppedError(self._refusal())
            if rid in self._streams:
                raise ValueError(f"request_id={rid!r} is already in use")
            self._streams[rid] = out_stream
            self._acks[rid] = ack
            self._processor.add(rid, text, token_ids, params, tuple(request.eos_token_ids), stream)
        self._send(AddRequests([request]))
        try:
            await asyncio.wrap_future(ack)
        except asyncio.CancelledError:
            out_stream.abort()
            raise
        except BaseException:
            with self._lock:
                self._streams.pop(rid, None)
                self._processor.drop(rid)
            raise
        return out_stream

    def _refusal(self) -> str:
        if self._dead is not None:
            return f"the engine core has died ({self._dead})"
        return (
            "the engine is not started" if self._reader is None else "the engine is shutting down"
        )

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread; a no-op for unknown or finished requests."""
        if self._dead is None:
            self._send(AbortRequests([request_id]))

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        timeout_s: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; the request is aborted if the consumer stops early."""
        s = await self.add_request(prompt, params, request_id, timeout_s)
        try:
            async for out in s:
                yield out
        finally:
            s.abort()

    def get_metrics(self) -> dict[str, Any]:
        return self.metrics.as_dict()

    def _send(self, msg) -> None:
        data = self._encode(msg)
        with self._send_lock:
            try:
                self._to_core.send(data, flags=zmq.NOBLOCK)
            except zmq.ZMQError as e:  # closed, or the core stopped reading
                logger.warning("could not reach the engine core: %s", e)

    # ---- the reader thread ------------------------------------------------------------------

    def _read(self) -> None:
        try:
            while True:
                if not self._from_core.poll(100):
                    if self._stopping:
                        return
                    if not self._alive():
                        self._die(f"the engine core process exited (code {self._proc.returncode})")
                        return
                    continue
                msg = self._decode(self._from_core.recv())
                if isinstance(msg, Failed):
                    self._die(f"the engine core died: {msg.reason}")
                    return
                if isinstance(msg, StepMessage):
                    self._handle(msg)
        except zmq.ZMQError:
            return  # closed by stop()
        except BaseException as e:  # noqa: BLE001 - a broken reader must fail every request
            logger.exception("engine core reader died")
            self._die(f"{type(e).__name__}: {e}")

    def _handle(self, msg: StepMessage) -> None:
        for rid in msg.accepted:
            fut = self._acks.pop(rid, None)
            if fut is not None and not fut.done():
                fut.set_result(None)
        for rej in msg.rejected:
            fut = self._acks.pop(rej.request_id, None)
            if fut is not None and not fut.done():
                kind = QueueFullError if rej.kind == "queue_full" else ValueError
                fut.set_exception(kind(rej.message))
        with self._lock:
            outputs, stopped = self._processor.process(msg.outputs)
        if stopped:
            self._send(AbortRequests(stopped, "stop"))
        self.metrics.observe(msg.outputs)
        deliver(self._streams, outputs, self._lock)

    def _die(self, reason: str) -> None:
        self._dead = reason
        self._accepting = False
        logger.error("%s", reason)
        self._fail_all(lambda: EngineDeadError(reason))

    def _fail_all(self, make_error: Callable[[], BaseException]) -> None:
        with self._lock:
            acks, self._acks = list(self._acks.values()), {}
            streams, self._streams = list(self._streams.values()), {}
        for fut in acks:
            if not fut.done():
                fut.set_exception(make_error())
        fail_streams(streams, make_error)

    def __del__(self) -> None:
        if getattr(self, "_proc", None) is not None and self._proc.poll() is None:
            self._proc.kill()
        if getattr(self, "_dir", None):
            for name in ("in", "out"):
                try:
                    os.unlink(os.path.join(self._dir, name))
                except OSError:
                    pass
