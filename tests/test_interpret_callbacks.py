"""The test harness's interpret-mode speed-up (interpret_callbacks.py) is in place on the pinned
JAX, and reaches no callback but the interpret mode's."""

from __future__ import annotations

import interpret_callbacks
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback


def test_installed_on_the_pinned_jax():
    # False would mean JAX's internals moved: the kernel tests would still pass, twice as slowly.
    assert interpret_callbacks.install()


def test_other_io_callbacks_still_get_jax_arrays():
    seen = []

    def record(x):
        seen.append(type(x))
        return np.asarray(x) + 1

    out = jax.jit(lambda x: io_callback(record, x, x))(jnp.arange(3))
    assert np.array_equal(out, [1, 2, 3])
    assert seen and all(issubclass(t, jax.Array) for t in seen)
