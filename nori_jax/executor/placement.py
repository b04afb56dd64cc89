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
    out = []
    for v in values:
        pieces = [jax.device_put(v, d) for d in devices]
        out.append(jax.make_array_from_single_device_arrays(v.shape, sharding, pieces))
    return tuple(out)
