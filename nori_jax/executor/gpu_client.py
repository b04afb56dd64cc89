"""Which of XLA's two GPU runtimes runs the engine: the TFRT GPU client or the default one.

JAX's CUDA plugin builds one of two PjRt clients when JAX starts its backends: XLA's default GPU
client, or its TFRT GPU client, picked by XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT (JAX passes it to
the plugin as `use_tfrt_gpu_client`). Both run the same compiled programs; they differ in the
host's work per launch, which is what a small batch waits on. On an H100 (docs/benchmarks.md,
"The TFRT GPU client"), with the device idle at each launch: 0.28-0.34 ms under TFRT against
0.70-0.75 ms under the default client at 16 to 1,024 sequences alike (two rounds, one lease);
with overlapped steps 0.34-0.42 ms; greedy tokens identical, with bf16 and with fp8 weights and
pages; the device-bound 2,000-request offline run the same (its launch share 8-9% against
16-17%); served load (four API servers, 1,000 requests at 128 and 256 req/s) without a failure.

"auto", the engine's default, takes TFRT for the engines measured under it: one GPU driven from
one process, bf16 or float32 weights and KV pages. Engines over several GPUs (tensor or data
parallel in one process, disaggregated, multi-host) and quantized weights or fp8 pages keep the
default client until they are measured under TFRT. A choice already in the environment stands,
and so does whatever a process that started JAX before the engine has.

The plugin reads the variable once: `apply` must run before any JAX call of the process (building
the engine does it first, beside xla_flags.apply). On a CPU the variable changes nothing.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

GPU_CLIENTS = ("auto", "default", "tfrt")
ENV = "XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT"


def in_effect(environ: dict[str, str] | None = None) -> str:
    """The client the environment gives ("tfrt" or "default"), read as JAX reads it."""
    value = (os.environ if environ is None else environ).get(ENV, "0")
    try:
        return "tfrt" if int(value) else "default"
    except ValueError:  # JAX's own int() would stop the backend's start with a bare traceback
        raise ValueError(f"{ENV}={value!r} must be an integer (1: the TFRT client)") from None


def apply(gpu_client: str, *, measured: bool) -> str:
    """Put the engine's client into the environment before JAX starts its backends; return the
    client in effect.

    `measured`: the engine is of a kind measured under TFRT ("auto" takes TFRT only then).
    ValueError for an unknown choice; RuntimeError if an explicit choice cannot take effect
    because JAX has started with the other client (a later change would silently do nothing).
    """
    if gpu_client not in GPU_CLIENTS:
        raise ValueError(f"gpu_client={gpu_client!r} must be one of {GPU_CLIENTS}")
    from jax._src import xla_bridge

    started = xla_bridge.backends_are_initialized()
    current = in_effect()
    if gpu_client == "auto":
        if ENV in os.environ or started:
            if started and ENV not in os.environ and measured:
                logger.info(
                    "GPU client: default (JAX started before the engine; %s=1 at process start "
                    "gives the TFRT client)",
                    ENV,
                )
            return current
        gpu_client = "tfrt" if measured else "default"
    if current == gpu_client:
        return current
    if started:
        raise RuntimeError(
            f"gpu_client={gpu_client!r} must reach JAX before this process starts using it: "
            f"build the engine before any other JAX call, or start the process with "
            f"{ENV}={int(gpu_client == 'tfrt')}"
        )
    os.environ[ENV] = "1" if gpu_client == "tfrt" else "0"
    logger.debug("GPU client: %s", gpu_client)  # the start-up log names it on a GPU
    return gpu_client
