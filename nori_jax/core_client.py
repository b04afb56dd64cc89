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
outputs to the event loop in one call.

Recovery: if the core process dies (killed, crashed, or ended by an exception no request is to
blame for), every request in flight gets an EngineDeadError (a JSON error at the HTTP layer),
`is_healthy` turns False, and the reader thread starts a new core process (its programs come from
the persistent compilation cache, so that takes seconds) and serves again. `nori:engine_restarts`
counts the restarts and `nori:engine_recovery_seconds` times the last one. After `max_restarts`
deaths within `restart_window_s` the client gives up and stays unhealthy.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import pickle
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable

import msgspec
import numpy as np
import zmq

from nori_jax.async_engine import (
    EngineDeadError,
    EngineStoppedError,
    RequestFailedError,
    RequestStream,
    deliver,
    fail_streams,
)
from nori_jax.client_base import StreamingClient, check_timeout
from nori_jax.core.engine_core import EngineCoreRequest
from nori_jax.core.output_processor import OutputProcessor
from nori_jax.core.scheduler import QueueFullError
from nori_jax.engine_config import EngineConfig
from nori_jax.engine_core_process import (
    AbortRequests,
    AddRequests,
    ClientReset,
    Control,
    ControlDone,
    CoreMessage,
    EngineInfo,
    Failed,
    Ready,
    Rejection,
    Shutdown,
    StepMessage,
)
from nori_jax.metrics import EngineMetrics
from nori_jax.prompts import encode_prompt
from nori_jax.sampling_params import ParameterError, SamplingParams
from nori_jax.socket_dirs import socket_dir
from nori_jax.tokenizer import Tokenizer
from nori_jax.weight_control import EngineAsleepError, EngineBusyError

logger = logging.getLogger(__name__)
_decode_message = msgspec.msgpack.Decoder(CoreMessage).decode
# The engine-core program, run by this Python: a benchmark of the API server alone points it at a
# fake core speaking the same protocol (benchmarks/engine/api_server_bench.py).
CORE_PROGRAM = ["-m", "nori_jax.engine_core_process"]


class _CoreProcess:
    """One engine-core process and the two sockets to it (fresh ones per process, so nothing
    queued for a dead process reaches its successor). `extra_clients`: the (input, output)
    addresses of other API servers that share this core (serve/api_servers.py)."""

    def __init__(
        self,
        zctx: zmq.Context,
        config: EngineConfig,
        directory: str,
        n: int,
        level,
        replica: int,
        extra_clients: list[tuple[str, str]] = (),
    ):
        env = replica_env(config, replica)  # before any socket: its ValueError leaves nothing
        self.paths = [os.path.join(directory, f"{name}-{n}") for name in ("in", "out")]
        self.to_core = _requests_socket(zctx)
        self.to_core.bind(f"ipc://{self.paths[0]}")
        self.from_core = zctx.socket(zmq.PULL)
        self.from_core.bind(f"ipc://{self.paths[1]}")
        inputs = [f"ipc://{self.paths[0]}", *(a for a, _ in extra_clients)]
        outputs = [f"ipc://{self.paths[1]}", *(b for _, b in extra_clients)]
        # A fresh interpreter (not multiprocessing): JAX is not fork-safe, and spawn would run
        # the caller's main module again in the child.
        cmd = [sys.executable, *CORE_PROGRAM, ",".join(inputs), ",".join(outputs)]
        cmd += [level, str(replica)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, env=env)
        self.proc.stdin.write(pickle.dumps(config))
        self.proc.stdin.close()

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def exit_description(self) -> str:
        return f"the engine core process exited (code {self.proc.returncode})"

    def wait(self, timeout_s: float) -> None:
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass  # close() kills it

    def wait_ready(self, timeout_s: float | None, cancelled: Callable[[], bool]) -> EngineInfo:
        return _wait_ready(self, timeout_s, cancelled)

    def kill(self) -> None:
        """SIGKILL (a stopped or hung process too); its death is then seen as any other."""
        if self.alive:
            self.proc.kill()

    def close(self) -> None:
        """Kill the process if it still runs, close the sockets, remove their files."""
        if self.alive:
            self.proc.kill()
        self.proc.wait()
        for sock in (self.to_core, self.from_core):
            sock.close(linger=0)
        for path in self.paths:
            try:
                os.unlink(path)
            except OSError:
                pass


def _requests_socket(zctx: zmq.Context) -> zmq.Socket:
    """The socket that carries requests and aborts to the core, with no high-water mark: while
    the core runs a long step it reads nothing, and ZeroMQ's default (1,000 messages) would
    refuse the rest of a burst (thousands of requests, or n = 64 choices each). Its size stays
    bounded by the requests this server has in flight; the core's own admission refuses past
    max_num_waiting."""
    sock = zctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 0)
    return sock


class _SharedCore:
    """The engine core another API server started (`--api-server-count`): this one binds its own
    pair of sockets, which the core connects to (and reconnects to after a restart), and watches
    the process by the id its Ready message gave."""

    def __init__(self, zctx: zmq.Context, input_addr: str, output_addr: str):
        self.to_core = _requests_socket(zctx)
        self.to_core.bind(input_addr)
        self.from_core = zctx.socket(zmq.PULL)
        self.from_core.bind(output_addr)
        self.pid: int | None = None

    def send_when_connected(self, data: bytes, timeout_s: float | None) -> None:
        """Send once the core has connected (it connects to every client's address as it
        starts)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            try:
                self.to_core.send(data, flags=zmq.NOBLOCK)
                return
            except zmq.Again:
                if deadline is not None and time.monotonic() > deadline:
                    raise RuntimeError(f"no engine core connected within {timeout_s} s") from None
                time.sleep(0.05)

    @property
    def alive(self) -> bool:
        if self.pid is None:
            return True  # not announced yet: the process that started it watches it
        try:  # a dead core stays a zombie until its parent reaps it: read its state
            with open(f"/proc/{self.pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False
        except OSError:  # no /proc: signal 0 tells whether the process exists
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                return False
            return True

    def exit_description(self) -> str:
        return f"the engine core process {self.pid} exited"

    def wait(self, timeout_s: float) -> None:
        pass  # the API server that started it stops it

    def wait_ready(self, timeout_s: float | None, cancelled: Callable[[], bool]) -> EngineInfo:
        info = _wait_ready(self, timeout_s, cancelled)
        self.pid = info.pid or None
        return info

    def close(self) -> None:
        for sock in (self.to_core, self.from_core):
            sock.close(linger=0)


def _wait_for(core, take, timeout_s: float | None, cancelled: Callable[[], bool], what: str):
    """Read a core that serves nothing yet until `take(message)` returns something (what it
    returns) or raises; RuntimeError if the core dies, the client stops, or `timeout_s` passes.
    Other messages (a step of a core that died before this one started) are nobody's now."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        if core.from_core.poll(200):
            got = take(_decode_message(core.from_core.recv()))
            if got is not None:
                return got
            continue
        if not core.alive:
            raise RuntimeError(f"{core.exit_description()} during {what}")
        if cancelled():
            raise RuntimeError(f"{what} cancelled: the client is stopping")
        if deadline is not None and time.monotonic() > deadline:
            raise RuntimeError(f"the engine core's {what} took over {timeout_s} s")


def _wait_ready(core, timeout_s: float | None, cancelled: Callable[[], bool]) -> EngineInfo:
    def take(msg) -> EngineInfo | None:
        if isinstance(msg, Failed):
            raise RuntimeError(f"the engine core failed to start: {msg.reason}")
        return msg.info if isinstance(msg, Ready) else None

    return _wait_for(core, take, timeout_s, cancelled, "start-up")


def _wait_control(core, token: str, timeout_s: float | None, cancelled: Callable[[], bool]) -> None:
    """Wait for the answer to weight operation `token` (replayed on a new core)."""

    def take(msg) -> bool | None:
        if not (isinstance(msg, ControlDone) and msg.token == token):
            return None
        if msg.kind != "ok":
            raise RuntimeError(f"replaying a weight operation failed: {msg.error}")
        return True

    _wait_for(core, take, timeout_s, cancelled, "replay of a weight operation")


def replica_env(config: EngineConfig, replica: int) -> dict[str, str] | None:
    """The environment of data-parallel replica `replica`'s engine-core process: this one's,
    with CUDA_VISIBLE_DEVICES narrowed to the replica's GPUs (mesh_config.py's device indices,
    taken within this process's own CUDA_VISIBLE_DEVICES when it has one), so that the process
    neither sees nor allocates memory on the other replicas' GPUs. None (inherit) for one
    replica. CPU processes own their host devices anyway."""
    if config.mesh.data < 2:
        return None
    env = dict(os.environ)
    visible = env.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(config.mesh.num_devices)]
    if len(ids) < config.mesh.num_devices:
        raise ValueError(
            f"mesh {config.mesh.describe()} needs {config.mesh.num_devices} devices; "
            f"CUDA_VISIBLE_DEVICES={visible!r} names {len(ids)}"
        )
    env["CUDA_VISIBLE_DEVICES"] = ",".join(ids[i] for i in config.mesh.device_indices(replica))
    return env


class EngineCoreClient(StreamingClient):
    """`replica` (data parallel, dp_client.py): which replica of `config.mesh` the core process
    runs, on that replica's devices only. `on_request_done(request_id)` is called (from the
    reader thread, or the caller's) once for every request that leaves this client: finished,
    failed, or refused.

    Several API servers on one core (serve/api_servers.py): the one that starts the core is
    client 0 and names the others' socket addresses in `extra_clients`; each other one is built
    with `shared_core=(input_addr, output_addr, client_index)`: it starts no process, binds its
    own pair, and waits for the core's Ready. When the core dies it fails its requests as client
    0 does and waits for the restarted core's Ready; client 0 alone restarts it.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        startup_timeout_s: float | None = None,
        log_level=None,
        max_restarts: int = 5,
        restart_window_s: float = 600.0,
        replica: int = 0,
        on_request_done: Callable[[str], None] | None = None,
        extra_clients: list[tuple[str, str]] = (),
        shared_core: tuple[str, str, int] | None = None,
        hang_timeout_s: float | None = None,
    ):
        self.config = config
        if hang_timeout_s is not None and not hang_timeout_s > 0:
            raise ValueError(f"hang_timeout_s={hang_timeout_s} must be > 0 or None")
        self.hang_timeout_s = hang_timeout_s
        self._heard = time.monotonic()  # the core's last message (or a busy spell's start)
        self.replica = replica
        self._on_done = on_request_done
        self.startup_timeout_s = startup_timeout_s
        self.max_restarts, self.restart_window_s = max_restarts, restart_window_s
        self._level = log_level or logging.getLevelName(logging.getLogger().getEffectiveLevel())
        # The sockets' directory: only the client that starts the core binds its sockets there.
        self._dir = socket_dir("core") if shared_core is None else None
        self._zmq = zmq.Context()
        self._generation = 0
        self._extra_clients = list(extra_clients)
        self.client_index = 0 if shared_core is None else shared_core[2]
        if shared_core is None:
            self._core = self._spawn()
        else:
            self._core = _SharedCore(self._zmq, shared_core[0], shared_core[1])
        try:
            if shared_core is not None:
                # Hello: the core answers with its Ready (it may have announced itself before
                # this process existed) and ends what it still runs for a predecessor's index.
                hello = msgspec.msgpack.encode(ClientReset(self.client_index))
                self._core.send_when_connected(hello, startup_timeout_s)
            self.info = self._core.wait_ready(startup_timeout_s, lambda: False)
        except BaseException:
            self._core.close()
            self._zmq.term()
            self._remove_dir()
            raise
        tok = self.info.tokenizer
        self.tokenizer: Tokenizer | None = Tokenizer.from_state(tok) if tok else None
        self.max_model_len = self.info.max_model_len
        self.metrics = EngineMetrics()
        self.metrics.set_model_config(self.info.model_config_info)
        self._send_lock = threading.Lock()
        self._encode = msgspec.msgpack.Encoder().encode
        self._processor = OutputProcessor(self.tokenizer)
        self._streams: dict[str, RequestStream] = {}  # guarded by _lock
        self._acks: dict[str, concurrent.futures.Future[None]] = {}
        self._lock = threading.Lock()
        self._accepting = False
        self._down: str | None = None  # why the engine is not serving now (None: it is)
        self._stopping = False
        self._closed = False
        self._restart_times: list[float] = []
        self.last_recovery_s: float | None = None
        self._num_restarts = 0
        self._reader: threading.Thread | None = None
        self._rng = unseeded_rng(config.seed, replica, self.client_index)
        # The weights and sleep state the weight operations left the core in (a checkpoint
        # path, a sleep level): replayed on a core that replaces a dead one. Client 0 hears of
        # the operations every API server sends (engine_core_process.ControlDone).
        self._weights_path: str | None = None
        self._sleep_level: int | None = None

    @property
    def owns_core(self) -> bool:
        """Whether this client started the core process (and restarts and stops it)."""
        return isinstance(self._core, _CoreProcess)

    def _spawn(self) -> _CoreProcess:
        self._generation += 1
        return _CoreProcess(
            self._zmq,
            self.config,
            self._dir,
            self._generation,
            self._level,
            self.replica,
            self._extra_clients,
        )

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
        return self._accepting and self._down is None and self._core.alive

    @property
    def dead_reason(self) -> str | None:
        """Why the engine does not serve, or None (serving, or only draining). A core process
        that ended says so at once, before the reader thread has taken in its death."""
        if self._down is None and not self._core.alive:
            return "the engine core process exited"
        return self._down

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    @property
    def pid(self) -> int | None:
        """The current engine-core process's id."""
        return self._core.pid

    @property
    def num_restarts(self) -> int:
        return self._num_restarts

    def stop_accepting(self) -> None:
        """Refuse new requests from now on (those in flight go on): the first step of a drain."""
        self._accepting = False

    async def shutdown(self, drain_timeout_s: float | None = None) -> None:
        """Refuse new requests, let those in flight finish (up to the timeout), stop the core.

        Requests still running after the timeout end with EngineStoppedError. Idempotent."""
        self._accepting = False
        deadline = None if drain_timeout_s is None else time.monotonic() + drain_timeout_s
        while self._streams and self._down is None:
            if deadline is not None and time.monotonic() >= deadline:
                logger.warning(
                    "drain timeout: stopping with %d requests in flight", len(self._streams)
                )
                break
            await asyncio.sleep(0.02)
        await asyncio.to_thread(self.stop)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the core now; requests in flight end with EngineStoppedError. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._accepting = False
            self._stopping = True
            core = self._core  # the reader installs no other from here on
        if core.alive and self.owns_core:
            self._send(Shutdown())
            core.wait(timeout_s)
        if self._down is None:
            self._down = "the engine was stopped"
        self._fail_all(lambda: EngineStoppedError("the engine was stopped"))
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(10)
        core.close()
        self._zmq.term()
        self._remove_dir()

    def _remove_dir(self) -> None:
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    # ---- requests ---------------------------------------------------------------------------

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Validate and encode a prompt (ParameterError on bad input)."""
        return encode_prompt(self.tokenizer, prompt, self.info.vocab_size, self.max_model_len)[0]

    async def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        timeout_s: float | None = None,
        stream: bool = True,
        priority: int = 0,
    ) -> RequestStream:
        """Queue a request; returns once the core has accepted it.

        Raises ParameterError / ValueError (bad input), QueueFullError (waiting queue full),
        EngineStoppedError (stopping, or the core is being restarted). `timeout_s` bounds the
        whole request, queueing included. Without `stream` the stream yields only the finished
        output. `priority`: under the core's scheduling policy "priority", lower runs first (the
        core refuses any other than 0 under "fcfs").
        """
        check_timeout(timeout_s)
        params.validate()
        params.check_vocab(self.info.vocab_size)
        token_ids, text = encode_prompt(
            self.tokenizer, prompt, self.info.vocab_size, self.max_model_len
        )
        arrival = time.monotonic()
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        rid = request_id or f"req-{uuid.uuid4().hex}"
        seed = params.seed if params.seed is not None else int(self._rng.integers(0, 2**31))
        request = EngineCoreRequest(
            rid, token_ids, params, seed, self.info.eos_token_ids, arrival, priority=priority
        )
        # Encoded before anything is registered: a request that cannot be sent leaves no trace.
        data = self._encode(AddRequests([msgspec.Raw(self._encode(request))], self.client_index))
        out_stream = RequestStream(rid, self, deadline)
        out_stream._timeout_s = timeout_s
        ack: concurrent.futures.Future[None] = concurrent.futures.Future()
        with self._lock:
            if not self._accepting or self._down is not None:
                raise EngineStoppedError(self._refusal())
            if rid in self._streams:
                raise ValueError(f"request_id={rid!r} is already in use")
            if not self._streams:  # a busy spell starts: the core's silence counts from here
                self._heard = time.monotonic()
            self._streams[rid] = out_stream
            self._acks[rid] = ack
            self._processor.add(rid, text, token_ids, params, tuple(request.eos_token_ids), stream)
        if (why := self._send_bytes(data)) is not None:
            with self._lock:
                self._streams.pop(rid, None)
                self._acks.pop(rid, None)
                self._processor.drop(rid)
            raise EngineStoppedError(f"could not reach the engine core: {why}")
        try:
            await asyncio.wrap_future(ack)
        except asyncio.CancelledError:
            out_stream.abort()
            raise
        except BaseException:
            with self._lock:
                self._streams.pop(rid, None)
                self._processor.drop(rid)
            self._done([rid])
            raise
        return out_stream

    def _refusal(self) -> str:
        if self._down is not None:
            return f"the engine is not serving ({self._down})"
        return (
            "the engine is not started" if self._reader is None else "the engine is shutting down"
        )

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread; a no-op for unknown or finished requests."""
        if self._down is None:
            self._send(AbortRequests([request_id]))

    async def control(self, op: str, level: int = 1, model_path: str | None = None) -> bool:
        """Run a weight operation in the core (engine_core_process.Control: "sleep",
        "wake_up", "update_weights", "is_sleeping"); the engine's sleeping state after it.
        Raises as the core answers: EngineBusyError (requests in flight), EngineAsleepError,
        ValueError (a bad level or path, weights that do not fit; nothing changed),
        RequestFailedError; EngineStoppedError while stopping or restarting, EngineDeadError if
        the core dies meanwhile."""
        token = f"ctl-{uuid.uuid4().hex}"
        data = self._encode(Control(token, op, self.client_index, level, model_path))
        done: concurrent.futures.Future[bool] = concurrent.futures.Future()
        with self._lock:
            if not self._accepting or self._down is not None:
                raise EngineStoppedError(self._refusal())
            self._acks[token] = done
        why = self._send_bytes(data)
        if why is not None:
            with self._lock:
                self._acks.pop(token, None)
            raise EngineStoppedError(f"the engine core is unreachable: {why}")
        return await asyncio.wrap_future(done)

    def release_client(self, index: int) -> None:
        """API server `index`'s process exited: the core ends the requests it still runs for
        it (ClientReset), as the hello of a restarted one would, only sooner."""
        if self.owns_core and index != self.client_index:
            self._send(ClientReset(index))

    def _send(self, msg) -> None:
        self._send_bytes(self._encode(msg))

    def _send_bytes(self, data: bytes) -> str | None:
        """Send without blocking; why it could not be sent, or None."""
        with self._send_lock:
            try:
                self._core.to_core.send(data, flags=zmq.NOBLOCK)
            except zmq.ZMQError as e:  # closed or restarting
                logger.warning("could not reach the engine core: %s", e)
                return str(e)
        return None

    # ---- the reader thread ------------------------------------------------------------------

    def _read(self) -> None:
        """Serve the current core until it dies; then fail what was in flight and restart it."""
        while True:
            reason = self._serve_core(self._core)
            if reason is None:
                return  # stopping
            died = time.monotonic()
            self._die(reason)
            if not self._restart(reason, died):
                return

    def _serve_core(self, core: _CoreProcess | _SharedCore) -> str | None:
        """Handle the core's messages; return why it died, or None once the client stops."""
        try:
            while True:
                if not core.from_core.poll(100):
                    if self._stopping:
                        return None
                    if not core.alive:
                        return core.exit_description()
                    if (quiet := self._hung_for()) is not None:
                        core.kill()
                        return (
                            f"the engine core sent nothing for {quiet:.0f} s with requests in "
                            "flight: taken for hung and killed"
                        )
                    continue
                self._heard = time.monotonic()
                msg = _decode_message(core.from_core.recv())
                if isinstance(msg, Failed):
                    return f"the engine core died: {msg.reason}"
                if isinstance(msg, StepMessage):
                    self._handle(msg)
                elif isinstance(msg, ControlDone):
                    self._control_done(msg)
        except zmq.ZMQError:
            return None if self._stopping else "the engine core's socket failed"
        except BaseException as e:  # noqa: BLE001 - a broken reader must fail every request
            logger.exception("engine core reader failed")
            return f"the client's reader failed: {type(e).__name__}: {e}"

    def _hung_for(self) -> float | None:
        """Seconds of the core's silence, where they make it hung. A busy core sends every
        client a message each step (milliseconds); one that sends nothing for `hang_timeout_s`
        while this client has requests in flight is hung (a device that never returns, a
        deadlock): the client that started it kills it, which fails those requests and restarts
        it, instead of every request waiting for ever behind a /health that says 200. Not while
        a weight operation (which may load a checkpoint for minutes) is under way."""
        if self.hang_timeout_s is None or not self.owns_core:
            return None
        quiet = time.monotonic() - self._heard
        if quiet <= self.hang_timeout_s:
            return None
        with self._lock:
            busy = bool(self._streams) and not any(t.startswith("ctl-") for t in self._acks)
        return quiet if busy else None

    def _handle(self, msg: StepMessage) -> None:
        for rid in msg.accepted:
            fut = self._acks.pop(rid, None)
            if fut is not None and not fut.done():
                fut.set_result(None)
        for rej in msg.rejected:
            fut = self._acks.pop(rej.request_id, None)
            if fut is not None and not fut.done():
                fut.set_exception(_rejection_error(rej))
        with self._lock:
            outputs, ended = self._processor.process(msg.outputs)
        for reason in set(ended.values()):
            self._send(AbortRequests([r for r, why in ended.items() if why == reason], reason))
        self.metrics.observe(msg.outputs)
        deliver(self._streams, outputs, self._lock)
        self._done([f.request_id for f in msg.outputs.finished])

    def _control_done(self, msg: ControlDone) -> None:
        with self._lock:
            done = self._acks.pop(msg.token, None)
        if msg.kind == "ok" and msg.op not in ("", "is_sleeping"):
            # This client's own operation, or (client 0) one another API server sent
            self._note_weight_op(msg)
        if done is None or done.done():
            return
        if msg.kind == "ok":
            done.set_result(msg.is_sleeping)
        else:
            done.set_exception(_control_error(msg))

    def _note_weight_op(self, msg: ControlDone) -> None:
        """Count a weight operation done on the core (the core keeps no metrics), and keep what
        a new core must be brought to should this one die (_replay_weight_state)."""
        new_weights = msg.op == "update_weights" or (
            msg.op == "wake_up" and msg.model_path is not None
        )
        self.metrics.observe_weight_op(msg.op, msg.is_sleeping, new_weights)
        if new_weights and msg.model_path is not None:
            self._weights_path = msg.model_path
        if msg.op in ("sleep", "wake_up"):
            self._sleep_level = msg.level if msg.is_sleeping and msg.op == "sleep" else None

    def _die(self, reason: str) -> None:
        self._down = reason
        logger.error("%s", reason)
        with self._lock:  # accepted ones: those not accepted yet may be served elsewhere
            failed = sum(rid not in self._acks for rid in self._streams)
        self.metrics.observe_engine_death(failed)
        self._fail_all(lambda: EngineDeadError(reason))

    def _restart(self, reason: str, died: float) -> bool:
        """Replace the dead core with a new process; False if the client gives up (or stops)."""
        if not self.owns_core:
            return self._await_restart(reason, died)
        now = time.monotonic()
        self._restart_times = [t for t in self._restart_times if now - t < self.restart_window_s]
        if len(self._restart_times) >= self.max_restarts:
            self._down = (
                f"{reason}; not restarted: {len(self._restart_times)} restarts within "
                f"{self.restart_window_s:g} s"
            )
            logger.error("%s", self._down)
            return False
        self._restart_times.append(now)
        self._down = f"restarting the engine core after: {reason}"
        logger.warning("%s", self._down)
        with self._send_lock:
            self._core.close()
        try:
            core = self._spawn()
            core.wait_ready(self.startup_timeout_s, lambda: self._stopping)
            self._replay_weight_state(core)
        except Exception as e:  # noqa: BLE001
            core.close()
            self._down = f"{reason}; the restart failed: {e}"
            logger.error("%s", self._down)
            return False
        with self._lock:
            if self._stopping:
                core.close()
                return False
            with self._send_lock:
                self._core = core
            self._processor = OutputProcessor(self.tokenizer)  # the dead core's requests failed
            self._down = None
        self._recovered(died, core.pid)
        return True

    def _replay_weight_state(self, core: _CoreProcess) -> None:
        """Bring a new core to the weights and sleep state its predecessor was left in: a new
        process loads the configured checkpoint, so after update_weights a restarted core served
        the original weights (a data-parallel server then answered with two models, /health 200),
        and one restarted while the others slept came back awake. Runs before the core serves
        anything; RuntimeError if it cannot (the restart then fails, as any other)."""
        ops = []
        if self._weights_path is not None:
            ops.append(("update_weights", 1, self._weights_path))
        if self._sleep_level is not None:
            ops.append(("sleep", self._sleep_level, None))
        for op, level, path in ops:
            token = f"ctl-replay-{uuid.uuid4().hex}"
            core.to_core.send(self._encode(Control(token, op, self.client_index, level, path)))
            _wait_control(core, token, self.startup_timeout_s, lambda: self._stopping)
            logger.info("the new engine core replayed %s%s", op, f" {path}" if path else "")

    def _await_restart(self, reason: str, died: float) -> bool:
        """A shared core died: wait for the core that client 0 starts in its place (its Ready
        arrives on this client's own sockets); False once this client stops."""
        self._down = f"waiting for the engine core's restart after: {reason}"
        logger.warning("%s", self._down)
        core = self._core
        core.pid = None  # the next Ready names the new process
        try:
            info = core.wait_ready(None, lambda: self._stopping)
        except RuntimeError as e:
            if not self._stopping:
                self._down = f"{reason}; no restarted engine core: {e}"
                logger.error("%s", self._down)
            return False
        with self._lock:
            if self._stopping:
                return False
            self.info = info
            self._processor = OutputProcessor(self.tokenizer)  # the dead core's requests failed
            self._down = None
        self._recovered(died, core.pid)
        return True

    def _recovered(self, died: float, pid: int | None) -> None:
        self.last_recovery_s = time.monotonic() - died
        self._num_restarts += 1
        self.metrics.engine_restarts.inc()
        self.metrics.engine_recovery.set(self.last_recovery_s)
        logger.warning("engine core restarted in %.2f s (process %s)", self.last_recovery_s, pid)

    def _fail_all(self, make_error: Callable[[], BaseException]) -> None:
        with self._lock:
            acks, self._acks = list(self._acks.values()), {}
            streams, self._streams = list(self._streams.values()), {}
        # Released first: a request the core never accepted may be routed to another replica
        # once its acceptance fails (dp_client.py), and a release after that would drop the
        # new replica's claim on it.
        self._done([s.request_id for s in streams])
        for fut in acks:
            if not fut.done():
                fut.set_exception(make_error())
        fail_streams(streams, make_error)

    def _done(self, request_ids: list[str]) -> None:
        if self._on_done is not None:
            for rid in request_ids:
                self._on_done(rid)

    def __del__(self) -> None:
        core = getattr(self, "_core", None)
        if isinstance(core, _CoreProcess) and core.alive:
            core.proc.kill()


def unseeded_rng(seed: int, replica: int, client_index: int) -> np.random.Generator:
    """The generator that draws the seeds of this client's unseeded requests. Each data-parallel
    replica and each API server has a client of its own, and with one generator seeded alike
    the k-th unseeded request of each got the same seed: the same prompt then sampled the same
    tokens on every replica (an `n=2` request split over two replicas answered twice alike). The
    first client keeps `seed`'s own stream, as the in-process engine's."""
    if replica == 0 and client_index == 0:
        return np.random.default_rng(seed)
    return np.random.default_rng([seed, replica, client_index])


def _control_error(msg: ControlDone) -> Exception:
    errors = {"busy": EngineBusyError, "asleep": EngineAsleepError, "invalid": ValueError}
    return errors.get(msg.kind, RequestFailedError)(msg.error or msg.kind)


def _rejection_error(rej: Rejection) -> Exception:
    if rej.kind == "queue_full":
        return QueueFullError(rej.message)
    if rej.kind == "asleep":
        return EngineAsleepError(rej.message)
    if rej.kind == "invalid":
        return ParameterError(rej.param, rej.message) if rej.param else ValueError(rej.message)
    return RequestFailedError(f"request {rej.request_id} failed in the engine: {rej.message}")
