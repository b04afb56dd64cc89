"""TuningConfig.decode_wgs=2: decode items alternate between the two compute warpgroups (each
with its own split-decode staging); same results as the reference, in interpret mode. And every
tuning form the benchmark can ask for lowers for CUDA here on the CPU machine (Mosaic GPU's
lowering runs in Python; only the final PTX compile needs the GPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_cases import make_step

from pallas_kernels.ragged_paged_attention.pallas_attention import ragged_paged_attention_pallas
from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention_reference
from pallas_kernels.ragged_paged_attention.tuning import TuningConfig

pytestmark = pytest.mark.timeout(300)

# (page_size, q heads, kv heads, head_dim, kind, tuning): odd item counts per CTA, so warpgroup 1
# owns the last item of some CTAs; splits 1 (output staged in the Q slot) and 3 (per-warpgroup f32
# staging); a mixed step, where prefill tiles share the Q slots with decode items.
CASES = [
    (16, 8, 2, 64, "decode", TuningConfig(64, 2, 1, 3, decode_wgs=2)),
    (32, 4, 1, 128, "decode", TuningConfig(64, 2, 3, 2, decode_wgs=2)),
    (16, 6, 2, 64, "mixed", TuningConfig(64, 3, 2, 3, decode_wgs=2)),
]


@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: f"ps{c[0]}-g{c[1] // c[2]}-{c[4]}-s{c[5].decode_splits}"
)
def test_alternating_decode_warpgroups_match_reference(case):
    ps, hq, hkv, d, kind, tuning = case
    decode = [1, ps - 1, ps + 1, 2 * ps + 70, 5, 3 * ps]
    prefill = [(ps + 1, ps + 1), (3, 2 * ps - 1)] if kind == "mixed" else []
    step = make_step(
        7,
        decode_kv_lens=decode,
        prefill=prefill,
        page_size=ps,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        dtype=jnp.bfloat16,
    )
    kw = dict(sm_scale=d**-0.5, soft_cap=None)
    out = np.asarray(ragged_paged_attention_pallas(*step.args, **kw, tuning=tuning), np.float32)
    ref = np.asarray(ragged_paged_attention_reference(*step.args, **kw), np.float32)
    assert np.abs(out - ref).max() / np.abs(ref).max() < 2e-2
    assert np.all(out[step.num_valid_tokens :] == 0)


@pytest.mark.parametrize(
    "tuning",
    [
        TuningConfig(64, 3, 1, 132),
        TuningConfig(64, 2, 2, 132, decode_wgs=2),
        TuningConfig(64, 3, 1, 132, decode_wgs=2, items_ahead=True),
    ],
    ids=["default-form", "decode-wgs-2-split", "decode-wgs-2-ahead"],
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
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
