"""The engine-core process's input loop (`engine_core_process._serve`) drops a frame that does not
decode, whatever its bytes, and goes on serving: a bug in one API server, or a stray peer, must
not take the engine and every request in it down. Driven in this process, over inproc ZeroMQ
sockets, with the fake-device core."""

from __future__ import annotations

import threading
import time

import msgspec
import pytest
import zmq
from fake_runner import FakeDevice, FakeExecutor, make_scheduler

from nori_jax.core.engine_core import EngineCore, EngineCoreRequest
from nori_jax.engine_core_process import AddRequests, CoreMessage, StepMessage, _Clients, _serve
from nori_jax.sampling_params import SamplingParams

ENCODE = msgspec.msgpack.Encoder().encode
DECODE = msgspec.msgpack.Decoder(CoreMessage).decode


def _add(rid: str) -> bytes:
    request = EngineCoreRequest(
        rid, [3, 4, 5], SamplingParams(max_tokens=3, temperature=0.0), 0, [], time.monotonic()
    )
    return ENCODE(AddRequests([msgspec.Raw(ENCODE(request))]))


BAD_FRAMES = {
    "garbage": b"\xc1\xff\x00garbage",
    "empty": b"",
    "truncated": _add("t")[:-5],
    "not a message": ENCODE(42),
    "unknown tag": ENCODE(["Nope", 1]),
    "a field of the wrong type": ENCODE(["AbortRequests", 5]),
    "a client that is no index": ENCODE(["AddRequests", [], "x"]),
    "4 MiB of garbage": b"\xdd" + b"\xff" * (4 << 20),
}


@pytest.fixture
def core_loop():
    ctx = zmq.Context()
    to_core, inputs = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    inputs.bind("inproc://in")
    to_core.connect("inproc://in")
    from_core = ctx.socket(zmq.PULL)
    from_core.bind("inproc://out")
    clients = _Clients(ctx, ["inproc://out"])
    s = make_scheduler()
    core = EngineCore(s, s._builder, FakeExecutor(FakeDevice(s)), async_scheduling=True)
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            _serve(core, inputs, clients, ENCODE)
        except BaseException as e:  # noqa: BLE001 - the test reports it
            errors.append(e)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield to_core, from_core, thread, errors
    to_core.send(ENCODE(["Shutdown"]))
    thread.join(10)
    for sock in (to_core, inputs, from_core, *clients.sockets):
        sock.close(linger=0)
    ctx.term()


def _finishes(from_core: zmq.Socket, rid: str, timeout_s: float = 10.0) -> bool:
    """Whether `rid` was accepted and finished within the timeout."""
    accepted = finished = False
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not finished:
        if from_core.poll(100):
            msg = DECODE(from_core.recv())
            if isinstance(msg, StepMessage):
                accepted |= rid in msg.accepted
                finished |= any(f.request_id == rid for f in msg.outputs.finished)
    return accepted and finished


def test_frames_that_do_not_decode_are_dropped_and_the_core_serves_on(core_loop) -> None:
    to_core, from_core, thread, errors = core_loop
    to_core.send(_add("before"))
    assert _finishes(from_core, "before")
    for name, frame in BAD_FRAMES.items():
        to_core.send(frame)
        to_core.send(_add(f"after {name}"))
        assert _finishes(from_core, f"after {name}"), name
        assert thread.is_alive() and not errors, (name, errors)
    to_core.send_multipart([_add("first of two frames"), b"\x00junk"])
    assert _finishes(from_core, "first of two frames")
    to_core.send(_add("last"))
    assert _finishes(from_core, "last") and thread.is_alive() and not errors
