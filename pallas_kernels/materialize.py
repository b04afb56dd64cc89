"""`materialize(x)`: x, copied by one kernel into a buffer of the program's own.

XLA:GPU runs a program as one CUDA graph, and a node whose buffer moved since the last launch is
updated before the next one. A program input that is a fresh array on every call (the engine's
step buffer) moves every call, and with it every node that reads it: dozens of the forward
pass's kernels. Copied first, only the copy's node reads it; the others read the copy, which
lives in the program's temporary buffer (at a fixed address under XLA's `skip_temp` update
mode). XLA cannot make the copy itself: it folds a plain copy away, and fuses elementwise work
into each consumer, which then reads the input again. The copy is a Pallas (Triton) kernel on
GPUs; elsewhere (no CUDA graphs) `materialize` is the identity.
"""

from __future__ import annotations

import jax
from jax.experimental import pallas as pl

_MAX_BLOCK = 1024  # elements per program of the copy


def _copy_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]


def copy_kernel(x: jax.Array, *, interpret: bool = False) -> jax.Array:
    """The Pallas copy of `x` (any shape; its size must be a multiple of 16 elements)."""
    flat = x.reshape(-1)
    n = flat.shape[0]
    block = min(_MAX_BLOCK, n & -n)  # the largest power of two dividing n: no partial block
    if block < 16:
        raise ValueError(f"materialize needs a size that is a multiple of 16, got {x.shape}")
    out = pl.pallas_call(
        _copy_kernel,
        out_shape=jax.ShapeDtypeStruct((n,), x.dtype),
        grid=(n // block,),
        in_specs=[pl.BlockSpec((block,), lambda i: (i,))],
        out_specs=pl.BlockSpec((block,), lambda i: (i,)),
        interpret=interpret,
    )(flat)
    return out.reshape(x.shape)


def materialize(x: jax.Array) -> jax.Array:
    return jax.lax.platform_dependent(x, cuda=copy_kernel, default=lambda y: y)
