"""How process 0 hands each step to the follower processes of a multi-host engine, and learns
that they ran it.

Multi-controller JAX runs a program over several processes' devices only if every process
launches the same program with the same inputs in the same order. Process 0 plans a step; this
link sends its program (token bucket, sampler program) and its packed int32 buffer to every
follower, which launches the same compiled program and acknowledges once the step is done.

Why ZeroMQ and not `jax.experimental.multihost_utils.broadcast_one_to_all`: that broadcast is a
device collective. Every call blocks the host until the value is back (measured on two CPU
processes: 2.4 ms for 16 KiB, against ~0.1 ms over a socket), it compiles a program per buffer
shape, and on GPUs it takes the same NCCL streams as the
step's own all-reduces, so process 0 could not plan step N+1 while step N runs. A ZeroMQ message
costs process 0 a copy into a socket and no wait. ROUTER/DEALER, not PUB/SUB: PUB/SUB drops
messages for a subscriber that joins late or falls behind, and a lost step desynchronizes the
programs (a hang); ROUTER with mandatory routing delivers in order per follower, says at once when
a follower is gone (EHOSTUNREACH), and carries the acknowledgements back on the same socket.
ZeroMQ heartbeats (below) drop the connection to a process that stopped answering, and a socket
monitor reports the drop: a dead follower fails process 0 within seconds, a dead process 0 stops
the followers.

Messages (multipart, little-endian): step `[b"S", <q step, i bucket, i filter_rows>, kind,
buffer]` (the plan's packed int32 step buffer), stop `[b"X"]`; from a follower: hello `[b"H"]`,
done `[b"A", <q step>]`, failed `[b"E", text]`. No JAX here: the executor side is in multihost.py.
"""

from __future__ import annotations

import struct
import time

import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from nori_jax.core.sampling_modes import SamplerProgram

_STEP = struct.Struct("<qii")
_ACK = struct.Struct("<q")
HEARTBEAT_IVL_MS = 1000  # ZMTP pings on an idle connection
HEARTBEAT_TIMEOUT_MS = 5000  # no traffic for this long: the peer is gone


class FollowerLost(RuntimeError):
    """A follower process died, disconnected, failed or stopped answering: the engine, which
    spans every process, cannot run another step."""


class LeaderLost(RuntimeError):
    """Process 0 disconnected (died, or its host is unreachable)."""


def _configure(sock: zmq.Socket) -> zmq.Socket:
    sock.setsockopt(zmq.LINGER, 1000)
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)
    return sock


def _disconnected(monitor: zmq.Socket) -> bool:
    """Drain the monitor's events; True if a connection dropped."""
    dropped = False
    while monitor.poll(0):
        event = recv_monitor_message(monitor)
        dropped |= event["event"] == zmq.EVENT_DISCONNECTED
    return dropped


class StepLeader:
    """Process 0's end: bound on all interfaces, one connection per follower."""

    def __init__(self, num_processes: int, step_timeout_s: float):
        self.followers = [str(i).encode() for i in range(1, num_processes)]
        self.step_timeout_s = step_timeout_s
        self._ctx = zmq.Context()
        self._sock = _configure(self._ctx.socket(zmq.ROUTER))
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.port = self._sock.bind_to_random_port("tcp://*")
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._done = dict.fromkeys(self.followers, -1)  # last step each follower finished
        self._step = -1
        self.closed = False

    def wait_for_followers(self, timeout_s: float) -> None:
        """Block until every follower said hello (it has connected and built its engine)."""
        hello: set[bytes] = set()
        deadline = time.monotonic() + timeout_s
        while hello != set(self.followers):
            left = deadline - time.monotonic()
            missing = sorted(int(f) for f in set(self.followers) - hello)
            if left <= 0:
                raise FollowerLost(
                    f"follower processes {missing} did not connect to process 0 within "
                    f"{timeout_s:.0f}s"
                )
            for frames in self._receive(left, "process 0 waited for the followers to connect"):
                if frames[1] == b"H":
                    hello.add(frames[0])

    def send_step(self, bucket: int, program: SamplerProgram, buffer: np.ndarray) -> int:
        """Send the next step to every follower; returns its number."""
        self._step += 1
        header = _STEP.pack(self._step, bucket, program.filter_rows)
        frames = [b"S", header, program.kind.encode(), buffer]
        for follower in self.followers:
            self._send(follower, frames)
        return self._step

    def wait_done(self, step: int) -> None:
        """Block until every follower finished `step`; FollowerLost if one cannot."""
        deadline = time.monotonic() + self.step_timeout_s
        while True:
            behind = [f for f, done in self._done.items() if done < step]
            if not behind:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise FollowerLost(
                    f"follower processes {[int(f) for f in behind]} did not finish step {step} "
                    f"within {self.step_timeout_s:.0f}s (step_timeout_s)"
                )
            waiting = (
                f"process 0 waited for processes {[int(f) for f in behind]} to finish step {step}"
            )
            for follower, kind, *rest in self._receive(left, waiting):
                if kind == b"A":
                    self._done[follower] = _ACK.unpack(rest[0])[0]

    def stop(self) -> None:
        """Tell every follower to stop (best effort: some may be gone) and close the socket."""
        if self.closed:
            return
        self.closed = True
        for follower in self.followers:
            try:
                self._sock.send_multipart([follower, b"X"], flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        self._ctx.destroy(linger=1000)  # closes every socket; a stop still queued goes out

    def _send(self, follower: bytes, frames: list) -> None:
        try:
            self._sock.send_multipart([follower, *frames], copy=True)
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            raise FollowerLost(
                f"follower process {int(follower)} is gone (its connection to process 0 "
                "closed): the engine spans every process and cannot go on"
            ) from None

    def _receive(self, timeout_s: float, waiting: str) -> list[list[bytes]]:
        """The messages that arrive within `timeout_s` (at least one, or none at the timeout);
        FollowerLost on a dropped connection or a follower's error."""
        events = dict(self._poller.poll(max(1, int(timeout_s * 1000))))
        out = []
        while self._sock.poll(0):  # a follower's last words come before its disconnect
            frames = self._sock.recv_multipart()
            if frames[1] == b"E":
                error = frames[2].decode(errors="replace")
                raise FollowerLost(f"follower process {int(frames[0])} failed: {error}")
            out.append(frames)
        if self._monitor in events and _disconnected(self._monitor):
            raise FollowerLost(
                f"a follower process disconnected while {waiting} (it died, or its host "
                f"stopped answering for {HEARTBEAT_TIMEOUT_MS / 1000:.0f}s): the engine spans "
                "every process and cannot go on"
            )
        return out


class StepFollower:
    """A follower's end: connected to process 0, receives steps in order.

    Steps finish on a waiter thread (multihost.py) so that the main thread can launch the next
    step while one still runs; the waiter reports through `done_reporter()`, an in-process pair
    socket, and the main thread forwards the acknowledgement to process 0 (a ZeroMQ socket
    belongs to one thread)."""

    def __init__(self, host: str, port: int, process_id: int):
        self._ctx = zmq.Context()
        self._sock = _configure(self._ctx.socket(zmq.DEALER))
        self._sock.setsockopt(zmq.ROUTING_ID, str(process_id).encode())
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._done = self._ctx.socket(zmq.PAIR)
        self._done.bind(f"inproc://nori-done-{id(self)}")
        host = f"[{host}]" if ":" in host else host
        self._sock.connect(f"tcp://{host}:{port}")
        self._sock.send(b"H")
        self._poller = zmq.Poller()
        for sock in (self._sock, self._monitor, self._done):
            self._poller.register(sock, zmq.POLLIN)

    def done_reporter(self) -> zmq.Socket:
        """A socket for the waiter thread (only): it sends `[b"A", pack_step_number(step)]` when
        a step is done, `[b"E", text]` when one failed."""
        reporter = self._ctx.socket(zmq.PAIR)
        reporter.connect(f"inproc://nori-done-{id(self)}")
        return reporter

    def receive(self):
        """The next message from process 0: ("step", step, bucket, program, buffer) or
        ("stop",); meanwhile forwards finished steps. LeaderLost if process 0 is gone."""
        while True:
            events = dict(self._poller.poll())
            while self._done.poll(0):  # [b"A", step] or [b"E", text]: on to process 0
                self._sock.send_multipart(self._done.recv_multipart())
            if self._sock.poll(0):  # what arrived before a disconnect comes first (a stop)
                break
            if self._monitor in events and _disconnected(self._monitor):
                raise LeaderLost("process 0 disconnected: the engine is gone")
        frames = self._sock.recv_multipart()
        if frames[0] == b"X":
            return ("stop",)
        step, bucket, filter_rows = _STEP.unpack(frames[1])
        program = SamplerProgram(frames[2].decode(), filter_rows)
        return ("step", step, bucket, program, np.frombuffer(frames[3], np.int32))

    def failed(self, text: str) -> None:
        self._sock.send_multipart([b"E", text.encode()])

    def close(self) -> None:
        self._ctx.destroy(linger=1000)


def pack_step_number(step: int) -> bytes:
    return _ACK.pack(step)
