"""The engine core in a process of its own: the step loop and nothing else.

Serving runs the engine core apart from the API server (vLLM v1's EngineCore shape), so HTTP,
tokenization, detokenization, stop strings and SSE never take the GIL from the step loop. The two
talk over ZeroMQ (PUSH/PULL on IPC sockets) with msgspec msgpack messages:

    client -> core   AddRequests | AbortRequests | Shutdown
    core -> client   Ready (once, with the engine's facts and its tokenizer) | Failed |
                     StepMessage (per step: the step's outputs, plus which adds were accepted)

Between two steps the core drains every message waiting, so adds and aborts arrive in batches;
when it has nothing to run it blocks on its socket. The client side is core_client.py.

One request cannot end the process: each arrives as its own msgpack document and is decoded,
vetted and queued alone, and whatever that raises rejects that request only (the client hears
why, with the field at fault). Inside a step, the core fails a request alone where its settings
enter the step (`EngineCore`); any other exception ends the process with a `Failed` message, and
the client restarts it.
"""

from __future__ import annotations

import logging
import pickle
import sys
import traceback
from typing import Any

import msgspec
import zmq

from nori_jax.core.engine_core import EngineCoreRequest
from nori_jax.core.outputs import EngineCoreOutputs, FinishedRequest
from nori_jax.core.scheduler import QueueFullError
from nori_jax.engine_config import EngineConfig
from nori_jax.sampling_params import ParameterError

logger = logging.getLogger(__name__)


class AddRequests(msgspec.Struct, tag=True, array_like=True):
    requests: list[msgspec.Raw]  # each an encoded EngineCoreRequest, decoded on its own


class _RequestId(msgspec.Struct, array_like=True):
    """The leading field of an encoded EngineCoreRequest: enough to reject one that will not
    decode."""

    request_id: str


class AbortRequests(msgspec.Struct, tag=True, array_like=True):
    request_ids: list[str]
    reason: str = "abort"  # "abort" (the client went away) or "stop" (a stop string)


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


class Rejection(msgspec.Struct, array_like=True):
    request_id: str
    kind: str  # "queue_full" | "invalid" (bad input: `param` names the field) | "failed"
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


class Ready(msgspec.Struct, tag=True, array_like=True):
    info: EngineInfo


class Failed(msgspec.Struct, tag=True, array_like=True):
    reason: str


class StepMessage(msgspec.Struct, tag=True, array_like=True, gc=False):
    outputs: EngineCoreOutputs
    accepted: list[str]
    rejected: list[Rejection]


ClientMessage = AddRequests | AbortRequests | Shutdown
CoreMessage = Ready | Failed | StepMessage


def main() -> None:
    """`python -m nori_jax.engine_core_process INPUT_ADDR OUTPUT_ADDR LOG_LEVEL [REPLICA]`, with
    the pickled EngineConfig on stdin: a fresh interpreter, so nothing of the parent's main
    module runs."""
    input_addr, output_addr, log_level = sys.argv[1:4]
    replica = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    config = pickle.load(sys.stdin.buffer)
    run_engine_core(config, input_addr, output_addr, log_level, replica)


def run_engine_core(
    config: EngineConfig, input_addr: str, output_addr: str, log_level: str, replica: int = 0
):
    """Build the engine (data parallel: replica `replica`, on the devices this process was
    given), announce it, and run the loop until told to stop."""
    logging.basicConfig(
        level=log_level.upper(),
        format=f"%(asctime)s %(levelname)s engine-core{replica if config.mesh.data > 1 else ''} "
        "%(name)s: %(message)s",
        force=True,
    )
    ctx = zmq.Context()
    inputs = ctx.socket(zmq.PULL)
    inputs.connect(input_addr)
    outputs = ctx.socket(zmq.PUSH)
    outputs.connect(output_addr)
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
        )
        outputs.send(encode(Ready(info)))
        _serve(parts.core, inputs, outputs, encode)
    except BaseException as e:  # noqa: BLE001 - the client must hear why the core ended
        logger.exception("engine core died")
        reason = f"{type(e).__name__}: {e}"
        try:
            outputs.send(encode(Failed(reason)), flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        traceback.print_exc(file=sys.stderr)
        sys.exit(1)
    finally:
        inputs.close(linger=0)
        outputs.close(linger=1000)
        ctx.term()


def _serve(core, inputs: zmq.Socket, outputs: zmq.Socket, encode) -> None:
    decode = msgspec.msgpack.Decoder(ClientMessage).decode
    poller = zmq.Poller()
    poller.register(inputs, zmq.POLLIN)
    while True:
        busy = core.has_unfinished() or core.has_in_flight
        accepted: list[str] = []
        rejected: list[Rejection] = []
        aborted: list[FinishedRequest] = []
        if poller.poll(0 if busy else None):
            while True:
                try:
                    msg = decode(inputs.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
                if isinstance(msg, Shutdown):
                    return
                if isinstance(msg, AddRequests):
                    for raw in msg.requests:
                        rid, rejection = _add(core, raw)
                        if rejection is not None:
                            rejected.append(rejection)
                        elif rid is not None:
                            accepted.append(rid)
                else:
                    for rid in msg.request_ids:
                        finished = core.abort(rid, msg.reason)
                        if finished is not None:
                            aborted.append(finished)
        if core.has_unfinished():
            out = core.step()
        elif core.has_in_flight:
            out = core.drain()  # going idle: deliver the step still on the device
        else:
            out = EngineCoreOutputs.empty()
        out.finished.extend(aborted)
        if out.request_ids or out.finished or accepted or rejected or out.stats is not None:
            outputs.send(encode(StepMessage(out, accepted, rejected)), copy=False)


_decode_request = msgspec.msgpack.Decoder(EngineCoreRequest).decode
_decode_request_id = msgspec.msgpack.Decoder(_RequestId).decode


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
