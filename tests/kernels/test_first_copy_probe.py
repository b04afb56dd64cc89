"""benchmarks/kernels/first_copy_probe.py: each start-up variant copies what it should (interpret
mode) and lowers for CUDA here, so that a device call spends its time measuring, not failing."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

BENCH = pathlib.Path(__file__).parents[2] / "benchmarks"


def _probe():
    sys.path.insert(0, str(BENCH))  # the script imports trace_events from there
    spec = importlib.util.spec_from_file_location(
        "first_copy_probe", BENCH / "kernels" / "first_copy_probe.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PROBE = _probe()
CTAS = 2


@pytest.mark.parametrize("name", [n for n in PROBE.VARIANTS if n != "empty"])
def test_variant_copies_each_ctas_tile(name):
    x = jax.random.normal(jax.random.key(1), (CTAS * PROBE.ROWS, PROBE.D), jnp.bfloat16)
    idx = jnp.tile(jnp.arange(CTAS, dtype=jnp.int32), (PROBE.CHAIN_MAX, 1))
    kernel = PROBE.VARIANTS[name](CTAS, interpret=plgpu.InterpretGPUParams())
    np.testing.assert_array_equal(np.asarray(jax.jit(kernel)(x, idx)), np.asarray(x))


@pytest.mark.parametrize("name", list(PROBE.VARIANTS))
def test_variant_lowers_for_cuda(name):
    x = jax.ShapeDtypeStruct((132 * PROBE.ROWS, PROBE.D), jnp.bfloat16)
    idx = jax.ShapeDtypeStruct((PROBE.CHAIN_MAX, 132), jnp.int32)
    lowered = jax.jit(PROBE.VARIANTS[name](132, interpret=False)).trace(x, idx)
    assert "mosaic_gpu" in lowered.lower(lowering_platforms=("cuda",)).as_text()


def test_largest_kernel_per_call_splits_the_trace_totals():
    import collections

    import trace_events  # on sys.path through _probe()

    total = collections.Counter({"attn": 9_000, "copy": 3_000, "add": 600})
    top, us, others = trace_events.largest_kernel_per_call(total, calls=3)
    assert (top, us, others) == ("attn", 3.0, {"copy": 1.0, "add": 0.2})
