"""The engine with 8-bit KV pages (`kv_cache_dtype`) against the model's own dtype.

On the lookup model (greedy tokens with margins of several logits) fp8 pages give the same greedy
tokens as float32 pages, with zero recompiles, with the default scales and with calibrated ones
(`calculate_kv_scales`); the pages really are 8-bit and, dequantized with their scales, hold the
float32 engine's K/V to the format's precision; the memory budget buys four times the float32
pages; the metric names the dtype and the scales.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from lookup_model import write_lookup_model

from nori_jax import LLM, EngineConfig, SamplingParams
from nori_jax.executor.kv_cache import num_pages_for_memory
from nori_jax.executor.mesh import make_mesh
from nori_jax.mesh_config import MeshConfig
from nori_jax.weights.loader import load_model
from pallas_kernels.kv_layout import split_kv

SMALL = dict(
    dtype="float32",
    page_size=16,
    num_pages=48,
    max_num_seqs=4,
    max_num_batched_tokens=32,
    max_model_len=96,
    param_cache=False,
)
PROMPTS = [[5, 17, 33, 101, 7], [200, 2, 250, 9, 1], list(range(40, 70))]
KV_DTYPES = {"auto": "float32", "fp8": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
CALIBRATED = "fp8+calibrated"


@pytest.fixture(scope="module")
def lookup(tmp_path_factory):
    path = tmp_path_factory.mktemp("lookup")
    write_lookup_model(path)
    return path


@pytest.fixture(scope="module")
def engines(lookup) -> dict[str, LLM]:
    llms = {kv: LLM(str(lookup), kv_cache_dtype=kv, **SMALL) for kv in KV_DTYPES}
    llms[CALIBRATED] = LLM(str(lookup), kv_cache_dtype="fp8", calculate_kv_scales=True, **SMALL)
    return llms


@pytest.fixture(scope="module")
def greedy(engines) -> dict[str, list[list[int]]]:
    p = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    return {kv: [o.token_ids for o in llm.generate(PROMPTS, p)] for kv, llm in engines.items()}


@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2", CALIBRATED])
def test_fp8_pages_give_the_same_greedy_tokens_with_zero_recompiles(kv, engines, greedy):
    assert greedy[kv] == greedy["auto"]
    assert engines[kv].engine.num_recompiles == 0


@pytest.mark.parametrize("kv", list(KV_DTYPES))
def test_pages_are_stored_in_the_requested_dtype_and_hold_the_kv(kv, engines, greedy):
    pages = engines[kv].engine.runner.kv_pages
    assert {p.dtype.name for p in pages} == {KV_DTYPES[kv]}
    written = np.asarray(pages[0][1:].astype(jnp.float32))  # page 0 is the null page
    assert np.count_nonzero(written) > 0


def test_metric_names_the_kv_dtype_and_scales(engines):
    info = {kv: llm.get_metrics()["nori:model_config_info"] for kv, llm in engines.items()}
    assert (
        info["fp8"]["kv_cache_dtype"] == "float8_e4m3fn" and info["fp8"]["kv_scales"] == "default"
    )
    assert info["auto"]["kv_cache_dtype"] == "float32" and info["auto"]["kv_scales"] == "none"
    assert info[CALIBRATED]["kv_scales"] == "calibrated"


@pytest.mark.parametrize("kv", ["fp8", CALIBRATED])
def test_first_layer_pages_dequantize_to_the_float32_kv(kv, engines, greedy):
    """Same prompts, same allocator: layer 0's pages, times their scales, are the float32
    engine's K/V to e4m3's precision (3 mantissa bits: 2^-4 relative). Layer 0's K/V depend on
    the tokens alone; deeper layers' inputs carry the fp8 attention's own error."""
    runner = engines[kv].engine.runner
    scales = np.ones((len(runner.kv_pages), 2)) if runner.kv_scales is None else runner.kv_scales
    if kv == CALIBRATED:
        assert scales.shape == (len(runner.kv_pages), 2) and np.all(np.isfinite(scales))
        assert np.all(scales > 0) and not np.allclose(scales, 1.0)
    ref = np.asarray(engines["auto"].engine.runner.kv_pages[0][1:])
    # logical K and V (fp8 pages store V transposed, kv_layout.py)
    got = np.asarray(jnp.stack(split_kv(runner.kv_pages[0][1:]), axis=2).astype(jnp.float32))
    got = got * scales[0][None, None, :, None, None]  # axis 2: K, V
    assert np.count_nonzero(ref) > 0
    np.testing.assert_allclose(got, ref, rtol=2.0**-4, atol=float(scales[0].max()) * 2**-9)


def test_the_memory_budget_holds_four_times_the_float32_pages(lookup):
    mesh = make_mesh(MeshConfig())
    cfg = load_model(str(lookup), dtype="float32", mesh=mesh, param_cache=False).config
    pages = {
        name: num_pages_for_memory(cfg, 16, dtype, mesh, 0.9, 0.01)
        for name, dtype in (("f32", jnp.float32), ("fp8", jnp.float8_e4m3fn))
    }
    assert pages["fp8"] == pytest.approx(4 * pages["f32"], abs=4)


def test_fp8_pages_on_the_pallas_kernel_give_the_float32_tokens(lookup, engines):
    """The engine on the Mosaic GPU kernel (interpret mode on the CPU) with e4m3 pages of 32
    tokens (blocks of two pages: P V in two V^T chunks): the KV write (V stored transposed) and
    the kernel's read of it (Q and P in fp8) give the float32 engine's greedy tokens across a
    page boundary (the 30-token prompt's tokens 3-6 are past it; interpret mode costs seconds a
    step), with zero recompiles. The lookup model's tokens hardly depend on attention, so
    the logprobs carry the check: within 2e-4 of float32's (fp8 pages move them ~2e-5 here; a V
    laid out wrongly or read in the wrong chunk order, ~1e-3)."""
    p = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
    want = engines["auto"].generate(PROMPTS, p)
    kw = {**SMALL, "page_size": 32, "max_num_batched_tokens": 16}
    llm = LLM(str(lookup), kv_cache_dtype="fp8", attention_backend="pallas", **kw)
    got = llm.generate(PROMPTS, p)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    lp_got, lp_want = (np.asarray([o.logprobs for o in outs]) for outs in (got, want))
    assert np.abs(lp_got - lp_want).max() < 2e-4
    assert llm.engine.num_recompiles == 0


def test_unknown_kv_cache_dtype_is_a_clear_error():
    with pytest.raises(ValueError, match="kv_cache_dtype='int8' must be one of"):
        EngineConfig(model="unused", kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="calculate_kv_scales=True needs fp8 KV pages"):
        EngineConfig(model="unused", calculate_kv_scales=True)


def test_fp8_pages_on_the_kernel_need_pages_of_32_tokens(lookup):
    """The Pallas kernel reads fp8 pages of 32 tokens and more (V^T, kv_layout.py): a smaller
    page is refused by name before the model loads; the reference backend takes any page."""
    kw = {**SMALL, "kv_cache_dtype": "fp8", "attention_backend": "pallas"}
    with pytest.raises(ValueError, match="page_size=16 with kv_cache_dtype='fp8'"):
        LLM(str(lookup), **kw)
