"""The engine core in a process of its own: the step loop and nothing else.

Serving runs the engine core apart from the API server (vLLM v1's EngineCore shape), so HTTP,
tokenization, detokenization, stop strings and SSE never take the GIL from the step loop. The two
talk over ZeroMQ (PUSH/PULL on IPC sockets) with msgspec msgpack messages:

    client -> core   AddRequests | AbortRequests | ClientReset | Control | Shutdown
    core -> client   Ready (once, with the engine's facts and its tokenizer) | Failed |
                     StepMessage (per step: the step's outputs, plus which adds were accepted) |
                     ControlDone (a Control's answer, to the client that sent it)

Between two steps the core drains every message waiting, so adds and aborts arrive in batches;
when it has nothing to run it blocks on its socket. The client side is core_client.py.

Several API server processes (`nori-jax serve --api-server-count N`, serve/api_servers.py) share
one core: client 0 started it, clients 1.. are given to it as more socket pairs. Each add names
its client; each client gets the rows of its own requests, and every client gets the step's
finishes, first tokens and stats (what the metrics are made of), so each API server's /metrics is
the whole engine's. Sends to clients 1.. never block the step loop: a client that died only loses
its own outputs, and a restarted one sends ClientReset so the core ends what it had in flight.

One request cannot end the process: each arrives as its own msgpack document and is decoded,
vetted and queued alone, and whatever that raises rejects that request only (the client hears
why, with the field at fault). Inside a step, the core fails a request alone where its settings
enter the step (`EngineCore`); any other exception ends the process with a `Failed` message, and
the client restarts it.

`Control` swaps the weights, sleeps or wakes the engine (weight_control.py; the server's
/update_weights, /sleep, /wake_up and /is_sleeping): it runs between steps once the core is idle
(a step still on the device is finished first; requests queued or running refuse it as busy),
and while the engine sleeps every add is refused as "asleep".
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import time
import traceback
from typing import Any

import msgspec
import zmq

from nori_jax.child_process import leave_signals_to_parent
from nori_jax.core.engine_core import EngineCoreRequest
from nori_jax.core.outputs import EngineCoreOutputs, FinishedRequest
from nori_jax.core.scheduler import QueueFullError
from nori_jax.engine_config import EngineConfig
from nori_jax.heap_freeze import freeze_process_heap
from nori_jax.sampling_params import ParameterError
from nori_jax.weight_control import (
    EngineAsleepError,
    EngineBusyError,
    WeightControl,
    run_control,
    swap_refusal,
)

logger = logging.getLogger(__name__)


class AddRequests(msgspec.Struct, tag=True, array_like=True):
    requests: list[msgspec.Raw]  # each an encoded EngineCoreRequest, decoded on its own
    client: int = 0  # which API server sent them (their outputs go back to it alone)


class _RequestId(msgspec.Struct, array_like=True):
    """The leading field of an encoded EngineCoreRequest: enough to reject one that will not
    decode."""

    request_id: str


class AbortRequests(msgspec.Struct, tag=True, array_like=True):
    request_ids: list[str]
    reason: str = "abort"  # "abort" (the client went away) or "stop" (a stop string)


class ClientReset(msgspec.Struct, tag=True, array_like=True):
    """An API server's hello as it (re)starts: the core answers with its Ready, and aborts
    whatever it still runs for that client index (a dead predecessor's: its clients are gone)."""

    client: int


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


class Control(msgspec.Struct, tag=True, array_like=True):
    """A weight operation (`op`, one of weight_control.CONTROL_OPS); the answer, a ControlDone
    with the same `token`, goes to `client`. `model_path`: a Hugging Face directory on the
    core's machine (update_weights; wake_up with new weights)."""

    token: str
    op: str
    client: int = 0
    level: int = 1
    model_path: str | None = None


class ControlDone(msgspec.Struct, tag=True, array_like=True):
    """The answer to Control `token`, with the operation it answers. A sleep, wake-up or weight
    update done for a client other than 0 is also sent to client 0, which restarts the core and
    exports the metrics: it replays the state on a new core and counts the operation."""

    token: str
    is_sleeping: bool
    kind: str = "ok"  # "ok" | "busy" | "asleep" | "invalid" | "failed"
    error: str | None = None
    op: str = ""
    level: int = 1
    model_path: str | None = None


class Rejection(msgspec.Struct, array_like=True):
    request_id: str
    # "queue_full" | "invalid" (bad input: `param` names the field) | "asleep" | "failed"
    kind: str
    message: str
    param: str | None = None


class EngineInfo(msgspec.Struct):
    model_source: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    tokenizer: dict[str, Any] | None  # Tokenizer.to_state()
    load_seconds: float
    compile_seconds: float
    model_config_info: dict[str, str] = msgspec.field(default_factory=dict)  # LoadedModel's
    pid: int = 0  # the core process (API servers that did not start it watch it by this)


class Ready(msgspec.Struct, tag=True, array_like=True):
    info: EngineInfo


class Failed(msgspec.Struct, tag=True, array_like=True):
    reason: str


class StepMessage(msgspec.Struct, tag=True, array_like=True, gc=False):
    outputs: EngineCoreOutputs
    accepted: list[str]
    rejected: list[Rejection]


ClientMessage = AddRequests | AbortRequests | ClientReset | Control | Shutdown
CoreMessage = Ready | Failed | StepMessage | ControlDone


def main() -> None:
    """`python -m nori_jax.engine_core_process INPUT_ADDRS OUTPUT_ADDRS LOG_LEVEL [REPLICA]`,
    with the pickled EngineConfig on stdin: a fresh interpreter, so nothing of the parent's main
    module runs. The addresses are one per client, comma-separated, client 0's first."""
    input_addrs, output_addrs, log_level = sys.argv[1:4]
    replica = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    # The API server that started this process stops it (Shutdown, or a kill) after draining its
    # requests: a Ctrl-C or SIGTERM to the whole process group must not end it first. If that
    # process dies, the loop notices (its parent changes) and ends: nothing else would stop it.
    leave_signals_to_parent()
    config = pickle.load(sys.stdin.buffer)
    run_engine_core(config, input_addrs.split(","), output_addrs.split(","), log_level, replica)


def run_engine_core(
    config: EngineConfig,
    input_addrs: list[str],
    output_addrs: list[str],
    log_level: str,
    replica: int = 0,
):
    """Build the engine (data parallel: replica `replica`, on the devices this process was
    given), announce it to every client, and run the loop until client 0 says stop."""
    logging.basicConfig(
        level=log_level.upper(),
        format=f"%(asctime)s %(levelname)s engine-core{replica if config.mesh.data > 1 else ''} "
        "%(name)s: %(message)s",
        force=True,
    )
    if len(input_addrs) != len(output_addrs):
        raise ValueError(f"{len(input_addrs)} input and {len(output_addrs)} output addresses")
    ctx = zmq.Context()
    inputs = ctx.socket(zmq.PULL)
    inputs.setsockopt(zmq.RCVHWM, 0)  # a burst queues while a step runs (core_client.py)
    for addr in input_addrs:  # one socket fair-queues every client's messages
        inputs.connect(addr)
    clients = _Clients(ctx, output_addrs)
    encode = msgspec.msgpack.Encoder().encode
    try:
        from nori_jax.engine import build_engine

        parts = build_engine(config, replica, own_devices=True)
        tok = parts.tokenizer
        info = EngineInfo(
            parts.model.source,
            parts.max_model_len,
            parts.model.config.vocab_size,
            parts.eos_token_ids,
            tok.to_state() if tok is not None else None,
            parts.load_seconds,
            parts.runner.compile_seconds,
            parts.config_info,
            os.getpid(),
        )
        ready = encode(Ready(info))
        freeze_process_heap()  # this process is the engine alone: see heap_freeze.py
        clients.send_all(ready)
        core = parts.core
        control = WeightControl(
            lambda: [parts], core.has_unfinished, core.drain, swap_refusal(config)
        )
        _serve(core, inputs, clients, encode, ready, control)
    except BaseException as e:  # noqa: BLE001 - the clients must hear why the core ended
        logger.exception("engine core died")
        reason = f"{type(e).__name__}: {e}"
        clients.send_all(encode(Failed(reason)), block=False)
        traceback.print_exc(file=sys.stderr)
        sys.exit(1)
    finally:
        inputs.close(linger=0)
        clients.close()
        ctx.term()


class _Clients:
    """The output socket of each client, and which client each request belongs to."""

    def __init__(self, ctx: zmq.Context, output_addrs: list[str]):
        self.sockets = []
        for i, addr in enumerate(output_addrs):
            sock = ctx.socket(zmq.PUSH)
            if i:  # another API server: its outputs queue while it restarts, never block us
                sock.setsockopt(zmq.SNDHWM, 0)
            sock.connect(addr)
            self.sockets.append(sock)
        self.owner: dict[str, int] = {}

    def send_all(self, data: bytes, block: bool = True) -> None:
        for i, sock in enumerate(self.sockets):
            self._send(i, sock, data, block)

    def send_to(self, i: int, data: bytes) -> None:
        self._send(i, self.sockets[i], data)

    def _send(self, i: int, sock: zmq.Socket, data: bytes, block: bool = True) -> None:
        try:
            # Client 0 started this process and reads it for its life: back-pressure is fine.
            sock.send(data, flags=0 if (i == 0 and block) else zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as e:
            logger.warning("could not send to API server %d: %s", i, e)

    def send_step(self, out: EngineCoreOutputs, accepted, rejected, encode) -> None:
        """One step's message to each client: its own rows and answers, everyone's finishes,
        first tokens and stats."""
        parts = (
            [out] if len(self.sockets) == 1 else split_outputs(out, self.owner, len(self.sockets))
        )
        for i, part in enumerate(parts):
            if _worth_sending(part, accepted[i], rejected[i]):
                self._send(i, self.sockets[i], encode(StepMessage(part, accepted[i], rejected[i])))
        if len(self.sockets) > 1:
            for f in out.finished:
                self.owner.pop(f.request_id, None)

    def close(self) -> None:
        for i, sock in enumerate(self.sockets):
            sock.close(linger=1000 if i == 0 else 0)


_IDLE_POLL_MS = 1000  # an idle core wakes this often (to see whether its parent still runs)


def _worth_sending(out: EngineCoreOutputs, accepted: list, rejected: list) -> bool:
    return bool(out.request_ids or out.finished or accepted or rejected or out.stats is not None)


def split_outputs(
    out: EngineCoreOutputs, owner: dict[str, int], num_clients: int
) -> list[EngineCoreOutputs]:
    """Per client: the rows (tokens, logprobs) of its requests, and the step's finishes, first
    tokens, stats and transfers whole (its metrics are the whole engine's). A request of no known
    client goes to client 0."""
    rows: list[list[int]] = [[] for _ in range(num_clients)]
    for row, rid in enumerate(out.request_ids):
        rows[owner.get(rid, 0)].append(row)
    top = out.top_logprobs
    top_rows: list[list[int]] = [[] for _ in range(num_clients)]
    for row, rid in enumerate(top.request_ids if top is not None else ()):
        top_rows[owner.get(rid, 0)].append(row)
    # (a prompt's logprobs may complete in a step without a token of its request)
    prompt_logprobs: dict[int, dict] = {}
    for rid, value in out.prompt_logprobs.items():
        prompt_logprobs.setdefault(owner.get(rid, 0), {})[rid] = value
    tokens, logprobs = out.token_ids, out.logprobs
    parts = []
    for client, mine in enumerate(rows):
        ids = [out.request_ids[r] for r in mine]
        parts.append(
            EngineCoreOutputs(
                ids,
                tokens[mine].tobytes(),
                logprobs[mine].tobytes() if len(logprobs) else b"",
                out.finished,
                out.first_tokens,
                out.stats,
                out.transfers,
                top.select(top_rows[client]) if top is not None and top_rows[client] else None,
                prompt_logprobs.get(client, {}),
            )
        )
    return parts


def _serve(
    core,
    inputs: zmq.Socket,
    clients: _Clients,
    encode,
    ready: bytes = b"",
    control: WeightControl | None = None,
) -> None:
    decode = msgspec.msgpack.Decoder(ClientMessage).decode
    poller = zmq.Poller()
    poller.register(inputs, zmq.POLLIN)
    n = len(clients.sockets)
    parent = os.getppid()
    sent_s = 0.0  # the last iteration's send, reported with this one's step
    controls: list[Control] = []  # waiting for the step still on the device
    dropped = 0  # input frames that did not decode
    while True:
        busy = core.has_unfinished() or core.has_in_flight
        accepted: list[list[str]] = [[] for _ in range(n)]
        rejected: list[list[Rejection]] = [[] for _ in range(n)]
        aborted: list[FinishedRequest] = []
        events = poller.poll(0 if busy else _IDLE_POLL_MS)
        t_in = time.perf_counter()  # after the poll: an idle core's wait is not work
        if os.getppid() != parent:  # a cheap check; busy, a dead client 0 would block our sends
            logger.warning("the API server that started this engine core is gone: stopping")
            return
        if events:
            while True:
                try:
                    frame = inputs.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    msg = decode(frame)
                except (msgspec.DecodeError, msgspec.ValidationError) as e:
                    # A frame no client of this protocol sends (a bug, a stray peer): dropped
                    # alone, as a request that does not decode is refused alone (_add); it must
                    # not take the engine, and every request in it, down. (Logged at the first
                    # and every 1,000th: a stream of them must not flood the log either.)
                    dropped += 1
                    if dropped == 1 or dropped % 1000 == 0:
                        logger.warning(
                            "dropped a message of %d bytes that does not decode (%d so far): %s",
                            len(frame),
                            dropped,
                            e,
                        )
                    continue
                if isinstance(msg, Shutdown):
                    return
                if isinstance(msg, AddRequests):
                    client = msg.client if 0 <= msg.client < n else 0
                    asleep = control is not None and control.asleep
                    for raw in msg.requests:
                        rid, rejection = _refuse_asleep(raw) if asleep else _add(core, raw)
                        if rejection is not None:
                            rejected[client].append(rejection)
                        elif rid is not None:
                            accepted[client].append(rid)
                            if n > 1:
                                clients.owner[rid] = client
                elif isinstance(msg, Control):
                    controls.append(msg)
                elif isinstance(msg, ClientReset):
                    gone = [rid for rid, c in clients.owner.items() if c == msg.client]
                    for rid in gone:
                        finished = core.abort(rid, "abort")
                        if finished is not None:
                            aborted.append(finished)
                    if 0 < msg.client < n and ready:
                        clients.send_to(msg.client, ready)
                else:
                    for rid in msg.request_ids:
                        finished = core.abort(rid, msg.reason)
                        if finished is not None:
                            aborted.append(finished)
        received_s = time.perf_counter() - t_in
        if core.has_unfinished():
            out = core.step()
        elif core.has_in_flight:
            out = core.drain()  # going idle: deliver the step still on the device
        else:
            out = EngineCoreOutputs.empty()
        out.finished.extend(aborted)
        if out.stats is not None:
            out.stats.io_seconds, sent_s = received_s + sent_s, 0.0
        t_send = time.perf_counter()
        clients.send_step(out, accepted, rejected, encode)
        sent_s += time.perf_counter() - t_send
        if controls:
            controls = _run_controls(core, control, controls, clients, encode)


def _run_controls(core, control: WeightControl | None, controls, clients: _Clients, encode):
    """Answer each Control that can be: run it if the core is idle, refuse it as busy if
    requests are queued or running; those waiting for the step on the device are returned."""
    waiting = []
    for msg in controls:
        if msg.op != "is_sleeping" and not core.has_unfinished() and core.has_in_flight:
            waiting.append(msg)  # the next iteration drains it (nothing else to run)
            continue
        done = _control(control, msg)
        client = msg.client if 0 <= msg.client < len(clients.sockets) else 0
        clients.send_to(client, encode(done))
        if client != 0 and done.kind == "ok" and msg.op != "is_sleeping":
            clients.send_to(0, encode(done))  # client 0 keeps what a restarted core replays
    return waiting


def _control(control: WeightControl | None, msg: Control) -> ControlDone:
    """Run one Control; its answer, with the engine's sleeping state after it."""
    kind, error = "ok", None
    try:
        if control is None:
            raise ValueError("this engine core takes no weight operations")
        run_control(control, msg.op, msg.level, msg.model_path)
    except EngineBusyError as e:
        kind, error = "busy", str(e)
    except EngineAsleepError as e:
        kind, error = "asleep", str(e)
    except (ValueError, OSError) as e:  # a bad level or path, a checkpoint that does not fit
        kind, error = "invalid", str(e)
    except Exception as e:  # noqa: BLE001 - the client hears it; the loop goes on
        logger.exception("%s failed", msg.op)
        kind, error = "failed", f"{type(e).__name__}: {e}"
    asleep = control is not None and control.asleep
    return ControlDone(msg.token, asleep, kind, error, msg.op, msg.level, msg.model_path)


_decode_request = msgspec.msgpack.Decoder(EngineCoreRequest).decode
_decode_request_id = msgspec.msgpack.Decoder(_RequestId).decode


def _refuse_asleep(raw: msgspec.Raw) -> tuple[str | None, Rejection | None]:
    try:
        rid = _decode_request_id(raw).request_id
    except Exception:  # noqa: BLE001 - as _add: nobody to answer
        return None, None
    return rid, Rejection(rid, "asleep", "the engine is asleep (POST /wake_up first)")


def _add(core, raw: msgspec.Raw) -> tuple[str | None, Rejection | None]:
    """Decode, vet and queue one request: (its id, None), or (its id, why it was refused)."""
    try:
        rid = _decode_request_id(raw).request_id
    except Exception as e:  # noqa: BLE001
        logger.error("dropped an add without a request id: %s", e)
        return None, None  # nobody to answer (the client never sends one)
    try:
        core.add_request(_decode_request(raw))
    except QueueFullError as e:
        return rid, Rejection(rid, "queue_full", str(e))
    except ParameterError as e:
        return rid, Rejection(rid, "invalid", str(e), e.param)
    except msgspec.ValidationError as e:  # SamplingParams' own checks raise while decoding
        cause = e.__cause__
        param = cause.param if isinstance(cause, ParameterError) else None
        return rid, Rejection(rid, "invalid", str(cause or e), param)
    except ValueError as e:
        return rid, Rejection(rid, "invalid", str(e))
    except Exception as e:  # noqa: BLE001 - this request's fault or not, it fails alone
        logger.exception("request %s could not be added", rid)
        return rid, Rejection(rid, "failed", f"{type(e).__name__}: {e}")
    return rid, None


if __name__ == "__main__":
    main()
