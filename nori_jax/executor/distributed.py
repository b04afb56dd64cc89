"""Joining JAX's distributed runtime (`jax.distributed.initialize`) for a multi-host engine.

After `join`, `jax.devices()` lists every process's devices and a jitted program over a mesh of
them runs as one SPMD program, each process driving its own devices (multi-controller JAX). The
runtime also gives the processes a key-value store, used here to agree on a few start-up values.
"""

from __future__ import annotations

import logging

import jax
import numpy as np

from nori_jax.distributed_config import DistributedConfig

logger = logging.getLogger(__name__)

# The runtime declares a process dead after this many seconds without heartbeats and stops the
# others (its own, last-resort failure detection; step_broadcast.py notices a dead follower in
# about a second). Shutdown waits at most this long for the other processes at exit.
HEARTBEAT_TIMEOUT_S = 30
SHUTDOWN_TIMEOUT_S = 10
_joined: DistributedConfig | None = None


def join(config: DistributedConfig) -> None:
    """Initialize JAX's distributed runtime once per process, before any JAX computation.

    Idempotent for the same config; a second, different config is a ValueError, and joining after
    JAX already started its backends (in this process) a RuntimeError that says so.
    """
    global _joined
    if not config.enabled:
        return
    if _joined is not None:
        if _joined != config:
            raise ValueError(f"this process already joined {_joined}; cannot join {config}")
        return
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        raise RuntimeError(
            f"a multi-host engine ({config.num_processes} processes) must join JAX's distributed "
            "runtime before this process uses JAX; build the engine before any other JAX call"
        )
    # XLA:CPU needs a collectives library to run one program over several processes; the
    # setting touches only the CPU backend, so it is harmless where the devices are GPUs.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    logger.info(
        "joining JAX's distributed runtime at %s as process %d of %d",
        config.coordinator_address,
        config.process_id,
        config.num_processes,
    )
    jax.distributed.initialize(
        coordinator_address=config.coordinator_address,
        num_processes=config.num_processes,
        process_id=config.process_id,
        initialization_timeout=config.init_timeout_s,
        heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S,
        shutdown_timeout_seconds=SHUTDOWN_TIMEOUT_S,
    )
    _joined = config
    logger.info(
        "process %d of %d: %d local devices, %d in all",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
    )


def _client():
    from jax._src import distributed

    client = distributed.global_state.client
    assert client is not None, "join() first"
    return client


def publish(key: str, value: str) -> None:
    """Set a key in the runtime's key-value store (visible to every process)."""
    _client().key_value_set(f"nori_jax/{key}", value)


def lookup(key: str, timeout_s: float) -> str:
    """Wait for a key another process publishes; a clear error when it does not come."""
    try:
        return _client().blocking_key_value_get(f"nori_jax/{key}", int(timeout_s * 1000))
    except Exception as e:
        raise RuntimeError(
            f"process {jax.process_index()}: no {key!r} from the other processes within "
            f"{timeout_s:.0f}s ({type(e).__name__}: {e})"
        ) from None


def agree_min(name: str, value: int, config: DistributedConfig) -> int:
    """The smallest of every process's `value` (each publishes its own, reads all of them), so
    sizes that depend on a host's free memory come out the same everywhere."""
    publish(f"{name}/{config.process_id}", str(int(value)))
    values = [
        int(lookup(f"{name}/{i}", config.init_timeout_s)) for i in range(config.num_processes)
    ]
    return int(np.min(values))
