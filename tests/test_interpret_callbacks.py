"""The test harness's interpret-mode speed-up (interpret_callbacks.py) is in place on the pinned
JAX, and reaches no callback but the interpret mode's."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import interpret_callbacks
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback


def test_installed_on_the_pinned_jax():
    # False would mean JAX's internals moved: the kernel tests would still pass, twice as slowly.
    assert interpret_callbacks.install()


def test_interpret_mode_callbacks_are_recognised():
    """The interpret mode wraps its callbacks (fail_on_exception) and binds their arguments
    (functools.partial): both must still name its module, or every callback takes JAX's slow
    path while install() reports success."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    bound = functools.partial(gpu_callbacks._clean_up_shared_memory)
    assert interpret_callbacks._is_interpret_callback(SimpleNamespace(callback_func=bound))
    assert not interpret_callbacks._is_interpret_callback(SimpleNamespace(callback_func=print))


def test_other_io_callbacks_still_get_jax_arrays():
    seen = []

    def record(x):
        seen.append(type(x))
        return np.asarray(x) + 1

    out = jax.jit(lambda x: io_callback(record, x, x))(jnp.arange(3))
    assert np.array_equal(out, [1, 2, 3])
    assert seen and all(issubclass(t, jax.Array) for t in seen)
