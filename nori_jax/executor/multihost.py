"""A multi-host engine: one engine over the devices of several processes.

Every process builds the same model and runner over the global mesh (its `model` axis spans the
processes' devices) and compiles and warms the same programs in the same order. Process 0 then
runs the engine core (scheduler, plan builder, server) with a `LeaderExecutor`: each launch first
sends the step's program and buffers to the followers (step_broadcast.py), then launches it
locally. A follower runs `run_follower`: it launches every step it receives, in order, with the
same inputs, as multi-controller JAX requires. The sampled tokens come out replicated over the
mesh; process 0 reads its own copy.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading

import numpy as np
import zmq

from nori_jax.core.step_plan import StepPlan
from nori_jax.distributed_config import DistributedConfig
from nori_jax.executor import distributed
from nori_jax.executor.compile_counter import CompileCounter
from nori_jax.executor.runner import ModelRunner
from nori_jax.executor.step_broadcast import LeaderLost, StepFollower, StepLeader, pack_step_number

logger = logging.getLogger(__name__)
_PORT_KEY = "step_port"


class LeaderExecutor:
    """The runner of process 0: every step goes to the followers before it is launched here, and
    is fetched once they all finished it (so a lost follower raises FollowerLost rather than
    leaving process 0 blocked in a collective that will never complete)."""

    def __init__(self, runner: ModelRunner, config: DistributedConfig):
        self.runner = runner
        self.link = StepLeader(config.num_processes, config.step_timeout_s)
        distributed.publish(_PORT_KEY, str(self.link.port))
        logger.info("waiting for %d follower processes", config.num_processes - 1)
        self.link.wait_for_followers(config.init_timeout_s)
        logger.info("all %d processes ready", config.num_processes)
        atexit.register(self.close)

    def launch(self, plan: StepPlan):
        step = self.link.send_step(plan.bucket, plan.sampler, plan.buffer)
        return step, self.runner.launch(plan)

    def fetch(self, handle) -> tuple[np.ndarray, np.ndarray]:
        step, launched = handle
        self.link.wait_done(step)
        return self.runner.fetch(launched)

    def close(self) -> None:
        """Tell the followers to stop (at exit, or when the engine is done)."""
        self.link.stop()


def run_follower(runner: ModelRunner, config: DistributedConfig) -> int:
    """Execute process 0's steps until it says stop; returns the programs built after warm-up
    (0 unless something is wrong). LeaderLost if process 0 goes away: then steps may still be
    blocked on the device, and the caller should exit the process rather than wait for them."""
    port = int(distributed.lookup(_PORT_KEY, config.init_timeout_s))
    link = StepFollower(config.coordinator_host, port, config.process_id)
    logger.info("process %d following process 0's steps", config.process_id)
    launched: queue.SimpleQueue = queue.SimpleQueue()
    waiter = threading.Thread(
        target=_report_done, args=(launched, link.done_reporter()), name="nori-step-waiter"
    )
    waiter.start()
    compiles = CompileCounter()
    steps = 0
    try:
        while True:
            message = link.receive()
            if message[0] == "stop":
                break
            _, step, bucket, program, buffer = message
            with compiles.counting():
                samples = runner.launch_buffer(bucket, buffer, program)
            launched.put((step, samples))
            steps += 1
    except LeaderLost:
        raise  # the waiter may be blocked in a collective with a dead peer: do not join it
    except Exception as e:
        link.failed(f"{type(e).__name__}: {e}")
        raise
    launched.put(None)
    waiter.join()
    link.close()
    logger.info("process %d: stopped after %d steps", config.process_id, steps)
    return compiles.count


def _report_done(launched: queue.SimpleQueue, reporter: zmq.Socket) -> None:
    """The waiter thread: block on each launched step in turn and report it finished."""
    try:
        while (item := launched.get()) is not None:
            step, samples = item
            try:
                samples.block_until_ready()
            except Exception as e:
                reporter.send_multipart([b"E", f"step {step}: {type(e).__name__}: {e}".encode()])
                return
            reporter.send_multipart([b"A", pack_step_number(step)])
    finally:
        reporter.close()
