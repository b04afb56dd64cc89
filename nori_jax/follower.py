"""A follower process of a multi-host engine: build the same engine, run process 0's steps.

`nori-jax serve` and `nori-jax generate` come here when `--process-id` is not 0 (a follower
serves nothing and generates nothing itself); from Python, `follow(config)`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator

from nori_jax.engine_config import EngineConfig
from nori_jax.executor.step_broadcast import FollowerLost, LeaderLost
from nori_jax.heap_freeze import freeze_process_heap

logger = logging.getLogger(__name__)


def follow(config: EngineConfig) -> int:
    """Join process 0's engine and execute its steps until it stops; the process's exit code.

    If process 0 goes away, steps may be blocked on the device in collectives that will never
    complete; the process then exits at once (status 1) rather than wait for them.
    """
    from nori_jax.engine import build_engine
    from nori_jax.executor.multihost import run_follower

    dist = config.distributed
    if not dist.enabled or dist.is_leader:
        raise ValueError(
            f"follow() runs a follower process (process_id >= 1 of num_processes >= 2); got "
            f"process_id={dist.process_id} of num_processes={dist.num_processes}"
        )
    parts = build_engine(config)
    freeze_process_heap()  # this process is the engine alone: see heap_freeze.py
    try:
        recompiles = run_follower(parts.runner, dist)
    except LeaderLost as e:
        logger.error("process %d: %s; exiting", dist.process_id, e)
        _exit_now(1)
    if recompiles:
        logger.warning("process %d built %d programs after warm-up", dist.process_id, recompiles)
    return 0


@contextlib.contextmanager
def exit_when_a_follower_is_lost() -> Iterator[None]:
    """Process 0's commands: a lost follower leaves steps on the device waiting for a dead peer,
    which the interpreter's exit would wait for too. Log the error and exit at once (status 1)."""
    try:
        yield
    except FollowerLost as e:
        logger.error("%s; exiting", e)
        _exit_now(1)


def _exit_now(status: int) -> None:
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
