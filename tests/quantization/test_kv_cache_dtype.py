"""The engine with 8-bit KV pages (`kv_cache_dtype`) against the model's own dtype.

On the lookup model (greedy tokens with margins of several logits) fp8 pages give the same greedy
tokens as float32 pages, with zero recompiles; the pages really are 8-bit and hold the written KV;
the memory budget buys four times the float32 pages; the metric and the log name the dtype.
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


@pytest.fixture(scope="module")
def lookup(tmp_path_factory):
    path = tmp_path_factory.mktemp("lookup")
    write_lookup_model(path)
    return path


@pytest.fixture(scope="module")
def engines(lookup) -> dict[str, LLM]:
    return {kv: LLM(str(lookup), kv_cache_dtype=kv, **SMALL) for kv in KV_DTYPES}


@pytest.fixture(scope="module")
def greedy(engines) -> dict[str, list[list[int]]]:
    p = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    return {kv: [o.token_ids for o in llm.generate(PROMPTS, p)] for kv, llm in engines.items()}


@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2"])
def test_fp8_pages_give_the_same_greedy_tokens_with_zero_recompiles(kv, engines, greedy):
    assert greedy[kv] == greedy["auto"]
    assert engines[kv].engine.num_recompiles == 0


@pytest.mark.parametrize("kv", list(KV_DTYPES))
def test_pages_are_stored_in_the_requested_dtype_and_hold_the_kv(kv, engines, greedy):
    pages = engines[kv].engine.runner.kv_pages
    assert {p.dtype.name for p in pages} == {KV_DTYPES[kv]}
    written = np.asarray(pages[0][1:].astype(jnp.float32))  # page 0 is the null page
    assert np.count_nonzero(written) > 0


def test_metric_names_the_kv_dtype(engines):
    info = engines["fp8"].get_metrics()["nori:model_config_info"]
    assert info["kv_cache_dtype"] == "float8_e4m3fn"
    assert engines["auto"].get_metrics()["nori:model_config_info"]["kv_cache_dtype"] == "float32"


def test_the_memory_budget_holds_four_times_the_float32_pages(lookup):
    mesh = make_mesh(MeshConfig())
    cfg = load_model(str(lookup), dtype="float32", mesh=mesh, param_cache=False).config
    pages = {
        name: num_pages_for_memory(cfg, 16, dtype, mesh, 0.9, 0.01)
        for name, dtype in (("f32", jnp.float32), ("fp8", jnp.float8_e4m3fn))
    }
    assert pages["fp8"] == pytest.approx(4 * pages["f32"], abs=4)


def test_unknown_kv_cache_dtype_is_a_clear_error():
    with pytest.raises(ValueError, match="kv_cache_dtype='int8' must be one of"):
        EngineConfig(model="unused", kv_cache_dtype="int8")
