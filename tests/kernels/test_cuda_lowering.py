"""The Mosaic GPU kernel lowers for CUDA here, on the CPU machine, in each tuning form the GPU
benchmark can ask for: Mosaic GPU's lowering runs in Python (layouts, TMA shapes, barriers), so
CI catches what interpret mode cannot; only the final PTX compile needs the GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.ragged_paged_attention.pallas_attention import ragged_paged_attention_pallas
from pallas_kernels.ragged_paged_attention.tuning import TuningConfig


@pytest.mark.parametrize(
    "tuning",
    [
        TuningConfig(64, 3, 1, 132),
        TuningConfig(64, 2, 2, 132, decode_wgs=2),
        TuningConfig(64, 3, 1, 132, decode_wgs=2),
        TuningConfig(128, 2, 1, 132, pingpong=True),
        TuningConfig(128, 2, 1, 132, decode_wgs=2, pingpong=True, producer_warps=4),
    ],
    ids=["default-form", "decode-wgs-2-split", "decode-wgs-2", "pingpong", "producer-warps-4"],
)
def test_kernel_lowers_for_cuda(tuning):
    """32 q / 8 kv heads, head_dim 128, page 16, bf16: the headline decode layout."""
    sds = jax.ShapeDtypeStruct
    args = (
        sds((64, 32, 128), jnp.bfloat16),
        sds((256, 8, 2, 16, 128), jnp.bfloat16),
        sds((16,), jnp.int32),
        sds((16, 64), jnp.int32),
        sds((17,), jnp.int32),
        sds((2,), jnp.int32),
    )
    traced = ragged_paged_attention_pallas.trace(
        *args, sm_scale=128**-0.5, tuning=tuning, interpret=False
    )
    assert "mosaic_gpu" in traced.lower(lowering_platforms=("cuda",)).as_text()
