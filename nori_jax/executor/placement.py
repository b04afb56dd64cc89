"""Host arrays onto a sharding without a collective, in one process or several.

`jax.device_put(numpy, sharding)` over devices of several processes first checks that every
process passed the same value: an all-gather of the whole array across hosts, once per call.
For weights (every process read the same file) and for the step's buffers (process 0 sent the
same bytes to every follower) that check is known to pass and too costly to run: here each
process copies only the pieces its own devices hold. Within one process it is device_put.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Sharding


def put(value: np.ndarray, sharding: Sharding) -> jax.Array:
    """`value` (the same on every process) onto `sharding`."""
    if sharding.is_fully_addressable:
        return jax.device_put(value, sharding)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def put_replicated(values: Sequence[np.ndarray], sharding: Sharding) -> tuple[jax.Array, ...]:
    """Several host arrays, each replicated over `sharding`'s devices: one transfer call in a
    single process; per local device and assembled, where the devices span processes."""
    if sharding.is_fully_addressable:
        return tuple(jax.device_put(tuple(values), sharding))
    devices = sorted(sharding.addressable_devices, key=lambda d: d.id)
    kind = sharding.memory_kind  # each piece in the memory the sharding names
    places = [jax.sharding.SingleDeviceSharding(d, memory_kind=kind) for d in devices]
    out = []
    for v in values:
        pieces = [jax.device_put(v, place) for place in places]
        out.append(jax.make_array_from_single_device_arrays(v.shape, sharding, pieces))
    return tuple(out)


class ReplicatedPut:
    """Host arrays of one fixed shape and dtype onto a replicated sharding, call after call: the
    step's buffer, every step.

    In one process it hands the array to the runtime's batched transfer directly, skipping
    `jax.device_put`'s per-call work (argument and sharding checks, its deferred-transfer
    objects): on the CPU machine 24 against 75 us a call, for the same runtime transfer. That
    entry point is JAX-internal (`xla_client.batched_device_put`, as of the pinned 0.11.2); without
    it, or across processes, this is `put_replicated`.
    """

    def __init__(self, shape: tuple[int, ...], dtype, sharding: Sharding):
        self.sharding = sharding
        self._fast = None
        if sharding.is_fully_addressable and sharding.is_fully_replicated:
            try:
                from jax._src.lib import xla_client

                self._fast = xla_client.batched_device_put
                self._aval = jax.core.ShapedArray(shape, np.dtype(dtype))
                self._devices = list(sharding._addressable_device_assignment)
            except (ImportError, AttributeError):
                self._fast = None

    def __call__(self, value: np.ndarray) -> jax.Array:
        if self._fast is not None and (
            value.shape != self._aval.shape or value.dtype != self._aval.dtype
        ):  # the runtime would take the bytes as they are
            raise ValueError(
                f"expected {self._aval.str_short()}, got {value.dtype}{list(value.shape)}"
            )
        if self._fast is None:
            return put_replicated((value,), self.sharding)[0]
        devices = self._devices
        return self._fast(self._aval, self.sharding, [value] * len(devices), devices, True)
