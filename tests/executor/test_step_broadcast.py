"""The multi-host step link (no JAX): steps arrive in order and intact, finished steps come back,
stop stops, and a follower or a process 0 that dies, hangs or fails is an error within a bounded
time, never a hang."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from nori_jax.core.sampling_modes import GREEDY, SamplerProgram
from nori_jax.executor.step_broadcast import (
    FollowerLost,
    LeaderLost,
    StepFollower,
    StepLeader,
    pack_step_number,
)


def _steps(n: int):
    for i in range(n):
        bucket = 16 * (i + 1)
        buffer = np.arange(4 * bucket + 40, dtype=np.int32) + i
        program = GREEDY if i % 2 == 0 else SamplerProgram("filter", 16)
        yield bucket, program, buffer


def test_steps_arrive_in_order_and_stop_stops():
    leader = StepLeader(num_processes=2, step_timeout_s=10)
    received = []

    def follow():
        link = StepFollower("127.0.0.1", leader.port, process_id=1)
        reporter = link.done_reporter()
        while (msg := link.receive())[0] == "step":
            received.append(msg[1:])
            reporter.send_multipart([b"A", pack_step_number(msg[1])])
        received.append(msg)
        reporter.close()
        link.close()

    thread = threading.Thread(target=follow, daemon=True)
    thread.start()
    try:
        leader.wait_for_followers(10)
        sent = list(_steps(3))
        for i, (bucket, program, buffer) in enumerate(sent):
            assert leader.send_step(bucket, program, buffer) == i
        leader.wait_done(2)
    finally:
        leader.stop()
    thread.join(10)
    assert not thread.is_alive()
    assert received[-1] == ("stop",)
    for i, (bucket, program, buffer) in enumerate(sent):
        step, got_bucket, got_program, got_buffer = received[i]
        assert (step, got_bucket, got_program) == (i, bucket, program)
        np.testing.assert_array_equal(got_buffer, buffer)


FOLLOWER = textwrap.dedent(
    """
    import sys, time
    from nori_jax.executor.step_broadcast import StepFollower
    link = StepFollower("127.0.0.1", int(sys.argv[1]), process_id=1)
    mode = sys.argv[2]
    msg = link.receive()
    if mode == "fail":
        link.failed("ValueError: bucket 16 was not compiled")
    print("received", flush=True)
    time.sleep(60)
    """
)


def _follower(port: int, mode: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", FOLLOWER, str(port), mode], stdout=subprocess.PIPE, text=True
    )


def _lead_one_step(step_timeout_s: float, mode: str):
    leader = StepLeader(num_processes=2, step_timeout_s=step_timeout_s)
    proc = _follower(leader.port, mode)
    leader.wait_for_followers(30)
    bucket, program, buffer = next(_steps(1))
    step = leader.send_step(bucket, program, buffer)
    assert proc.stdout.readline().strip() == "received"
    return leader, proc, step


def test_a_killed_follower_fails_the_leader_within_seconds():
    leader, proc, step = _lead_one_step(step_timeout_s=60, mode="hang")
    try:
        proc.kill()
        start = time.monotonic()
        with pytest.raises(FollowerLost, match=r"disconnected while process 0 waited for proc"):
            leader.wait_done(step)
        assert time.monotonic() - start < 5  # the closed connection, not the 60 s step timeout
    finally:
        leader.stop()


def test_a_hung_follower_fails_the_leader_after_the_step_timeout():
    leader, proc, step = _lead_one_step(step_timeout_s=0.5, mode="hang")
    try:
        with pytest.raises(FollowerLost, match=r"processes \[1\] did not finish step 0 within"):
            leader.wait_done(step)
    finally:
        proc.kill()
        leader.stop()


def test_a_follower_error_reaches_the_leader():
    leader, proc, step = _lead_one_step(step_timeout_s=30, mode="fail")
    try:
        with pytest.raises(FollowerLost, match="process 1 failed: ValueError: bucket 16"):
            leader.wait_done(step)
    finally:
        proc.kill()
        leader.stop()


def test_a_follower_that_never_connects_is_reported():
    leader = StepLeader(num_processes=3, step_timeout_s=1)
    link = StepFollower("127.0.0.1", leader.port, process_id=1)  # process 2 never comes
    try:
        with pytest.raises(FollowerLost, match=r"processes \[2\] did not connect"):
            leader.wait_for_followers(1.0)
    finally:
        link.close()
        leader.stop()


LEADER = textwrap.dedent(
    """
    import time
    from nori_jax.executor.step_broadcast import StepLeader
    leader = StepLeader(num_processes=2, step_timeout_s=10)
    print(leader.port, flush=True)
    leader.wait_for_followers(30)
    print("ready", flush=True)
    time.sleep(60)
    """
)


def test_a_dead_leader_stops_the_follower():
    proc = subprocess.Popen([sys.executable, "-c", LEADER], stdout=subprocess.PIPE, text=True)
    try:
        link = StepFollower("127.0.0.1", int(proc.stdout.readline()), process_id=1)
        assert proc.stdout.readline().strip() == "ready"
        proc.kill()
        start = time.monotonic()
        with pytest.raises(LeaderLost, match="process 0 disconnected"):
            link.receive()
        assert time.monotonic() - start < 5
        link.close()
    finally:
        proc.kill()
