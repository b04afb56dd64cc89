"""Mosaic GPU interpret mode's host callbacks, given their arguments as numpy arrays.

Interpret mode (the Pallas kernel tests, the engine tests on the Pallas backend) runs each
simulated warpgroup as an XLA CPU program that calls back into Python for every barrier, copy,
load and store. JAX's `io_callback` first places each callback's arguments on the CPU device
(`jax.device_put`, then the callbacks turn them back into numpy or Python ints): on a 2-core
machine that placement was 30% of a kernel test's samples under py-spy, and one split-prefill case
took 26.5 s against 10.9 s with the arguments handed over as the numpy arrays XLA gave. The
interpret mode's callbacks read their arguments with numpy (`np.asarray`, `.item()`), so they
compute the same thing either way; what this skips is the conversion.

Only callbacks of JAX's Mosaic GPU interpret mode get numpy arguments; any other `io_callback`
runs as JAX runs it. It reads JAX internals (the project pins jax 0.11.2:
`jax._src.callback.io_callback_impl`, `..interpret.shared_memory._to_int`); where they are not
as expected it changes nothing, and the tests run at JAX's own speed.
"""

from __future__ import annotations

import functools
import inspect

import numpy as np

_INTERPRET_MODULE = "jax._src.pallas.mosaic_gpu.interpret."


def _is_interpret_callback(flat_callback) -> bool:
    func = getattr(flat_callback, "callback_func", None)
    while isinstance(func, functools.partial):
        func = func.func
    return getattr(func, "__module__", "").startswith(_INTERPRET_MODULE)


def install() -> bool:
    """Patch the two functions; True if they were as expected and are now patched."""
    try:
        from jax._src import callback as jax_callback
        from jax._src import tree_util
        from jax._src.pallas.mosaic_gpu.interpret import shared_memory
    except ImportError:
        return False
    original_impl, original_to_int = jax_callback.io_callback_impl, shared_memory._to_int
    if getattr(original_impl, "numpy_arguments", False):
        return True  # already installed
    expected = ["args", "result_avals", "callback", "sharding", "ordered"]
    if list(inspect.signature(original_impl).parameters) != expected:
        return False

    def io_callback_impl(*args, result_avals, callback, sharding, ordered):
        if not _is_interpret_callback(callback):
            return original_impl(
                *args, result_avals=result_avals, callback=callback, sharding=sharding,
                ordered=ordered,
            )  # fmt: skip
        return tree_util.tree_map(np.asarray, callback(*args))

    def to_int(x):
        if isinstance(x, np.ndarray | np.generic):  # a numpy scalar from a callback
            return int(x)
        return original_to_int(x)

    io_callback_impl.numpy_arguments = True
    jax_callback.io_callback_impl = io_callback_impl
    shared_memory._to_int = to_int
    return True
