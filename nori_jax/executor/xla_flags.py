"""XLA:GPU settings the engine can ask for, applied before JAX starts its backends.

`command_buffer_update="skip_temp"`: XLA runs each compiled step as one CUDA graph (a command
buffer). By default ("always") it re-records the graph's nodes whenever a buffer moved since the
last launch, and the step's temporary buffer moves on every launch (two steps are in flight), so
every launch pays for an update of every node: on the H200, 1.4 ms of a 64-sequence step's 2.8 ms
dispatch, for 1.8 ms of device work (docs/benchmarks.md, "Host costs"). "skip_temp" has XLA map the
temporary buffer at a fixed virtual address (its VMM allocator), so launches skip those updates.

The mode needs XLA's VMM allocator, which XLA then picks instead of the default preallocating
one. It keeps no memory statistics (`memory_stats()` is None on the H200), so
`device_memory_limit` gives the KV pool the default allocator's budget from the device's total
memory. "auto", the engine's default, is skip_temp where it can still reach XLA.

XLA reads its flags once, when JAX starts its backends: `apply` must run before any JAX call of
the process (building the engine does it first); afterwards it only checks that the setting is
already in effect, and refuses otherwise.
"""

from __future__ import annotations

import ctypes
import logging
import os

logger = logging.getLogger(__name__)

COMMAND_BUFFER_UPDATES = ("auto", "always", "skip_temp")
_UPDATE_FLAG = "--xla_gpu_command_buffer_update_mode"
_MODE_VALUE = {"always": "ALWAYS_UPDATE", "skip_temp": "SKIP_TEMP"}
# JAX's share of a GPU's memory for its preallocating allocator (XLA_PYTHON_CLIENT_MEM_FRACTION).
DEFAULT_MEM_FRACTION = 0.75


def setting(xla_flags: str, name: str) -> str | None:
    """The value an XLA_FLAGS string gives the flag `name` (without dashes; its last setting;
    "true" for a bare boolean flag), or None where it does not name it."""
    value = None
    for word in xla_flags.split():
        flag, eq, given = word.lstrip("-").partition("=")
        if flag == name:
            value = given if eq else "true"
    return value


def flag_in(xla_flags: str) -> str | None:
    """The command-buffer update mode named in an XLA_FLAGS string (its last setting), or None."""
    return setting(xla_flags, _UPDATE_FLAG.lstrip("-"))


def with_update_mode(xla_flags: str, mode: str) -> str:
    """`xla_flags` with the update mode for `mode` (any earlier setting of it replaced)."""
    if mode not in _MODE_VALUE:
        raise ValueError(f"command_buffer_update={mode!r} must be one of {COMMAND_BUFFER_UPDATES}")
    return with_update_value(xla_flags, None if mode == "always" else _MODE_VALUE[mode])


def with_update_value(xla_flags: str, value: str | None) -> str:
    """`xla_flags` with XLA's update mode set to its enum name `value` (None: XLA's default), any
    earlier setting replaced. Benchmarks ask about modes the engine does not offer this way
    (SKIP_PROFILED: docs/benchmarks.md, "Host costs")."""
    kept = [w for w in xla_flags.split() if not w.startswith(_UPDATE_FLAG + "=")]
    if value is not None:
        kept.append(f"{_UPDATE_FLAG}={value}")
    return " ".join(kept)


def in_effect(mode: str, xla_flags: str | None = None) -> bool:
    """Whether XLA_FLAGS (`xla_flags`, default the environment's) gives the update mode `mode`."""
    given = flag_in(os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags)
    if mode == "always":
        return given in (None, _MODE_VALUE["always"])
    return given == _MODE_VALUE[mode]


def apply(command_buffer_update: str) -> str:
    """Put the engine's XLA settings into XLA_FLAGS before JAX starts its backends; return the
    mode in effect.

    "auto": skip_temp, unless XLA_FLAGS already names a mode (the user's choice stands) or JAX
    has started already (XLA read its flags then; the process keeps what it has, logged).
    ValueError for an unknown mode; RuntimeError if an explicit mode cannot take effect because
    JAX has started without it (a later change would silently do nothing).
    """
    if command_buffer_update not in COMMAND_BUFFER_UPDATES:
        raise ValueError(
            f"command_buffer_update={command_buffer_update!r} must be one of "
            f"{COMMAND_BUFFER_UPDATES}"
        )
    from jax._src import xla_bridge

    started = xla_bridge.backends_are_initialized()
    if command_buffer_update == "auto":
        given = flag_in(os.environ.get("XLA_FLAGS", ""))
        if given is not None or started:
            mode = "skip_temp" if given == _MODE_VALUE["skip_temp"] else "always"
            if started and given is None:
                logger.info(
                    "XLA command buffers: update mode always (JAX started before the engine; "
                    "XLA_FLAGS='%s' at process start gives skip_temp)",
                    with_update_mode("", "skip_temp"),
                )
            return mode
        command_buffer_update = "skip_temp"
    if in_effect(command_buffer_update):
        return command_buffer_update
    if started:
        flag = with_update_mode("", command_buffer_update) or f"{_UPDATE_FLAG}=ALWAYS_UPDATE"
        raise RuntimeError(
            f"command_buffer_update={command_buffer_update!r} must reach XLA before this process "
            f"starts using JAX: build the engine before any other JAX call, or start the process "
            f"with XLA_FLAGS='{flag}'"
        )
    os.environ["XLA_FLAGS"] = with_update_mode(
        os.environ.get("XLA_FLAGS", ""), command_buffer_update
    )
    logger.info("XLA command buffers: update mode %s", command_buffer_update)
    return command_buffer_update


def uses_vmm_allocator() -> bool:
    """Whether XLA:GPU runs its VMM allocator in this process (the skip_temp mode forces it)."""
    return not in_effect("always")


def device_memory_limit(local_hardware_id: int, mem_fraction: float | None = None) -> int:
    """The bytes JAX's preallocating allocator would take on this CUDA device: its total memory
    times XLA_PYTHON_CLIENT_MEM_FRACTION (0.75 unless set), read from the CUDA driver."""
    if mem_fraction is None:
        mem_fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", DEFAULT_MEM_FRACTION))
    return int(cuda_total_memory(local_hardware_id) * mem_fraction)


def cuda_total_memory(ordinal: int) -> int:
    """Total memory of CUDA device `ordinal` (as this process numbers them), from libcuda."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise RuntimeError(f"the CUDA driver library is not loadable: {e}") from None
    device, total = ctypes.c_int(), ctypes.c_size_t()
    for call, args in (
        ("cuInit", (0,)),
        ("cuDeviceGet", (ctypes.byref(device), ordinal)),
        ("cuDeviceTotalMem_v2", (ctypes.byref(total), device)),
    ):
        status = getattr(cuda, call)(*args)
        if status != 0:
            raise RuntimeError(f"{call} failed with CUDA error {status} (device {ordinal})")
    return total.value
