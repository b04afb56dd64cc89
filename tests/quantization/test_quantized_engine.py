"""The engine in each quantization mode against float32.

On the lookup model (lookup_model.py: greedy tokens with margins of several logits, decided by a
quantized MLP) the greedy tokens of every mode equal float32's, with zero recompiles; the logits
stay within two half-steps of the mode's grid (relative to the logits' range: int8 1/255 of it,
int4 1/15, fp8 1/16) and, for the weight-only modes, equal a float32 model holding the dequantized
weights. GGUF blocks kept as they are give float32's logits of the same file.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from gguf.constants import GGMLQuantizationType as Q
from lookup_model import write_lookup_model
from model_harness import PagedSequence
from safetensors.numpy import save_file

from nori_jax import LLM, SamplingParams
from nori_jax.executor.mesh import make_mesh
from nori_jax.mesh_config import MeshConfig
from nori_jax.quantization.quantize import dequantize_leaves
from nori_jax.weights.loader import load_model
from tests.weights.tiny_gguf import write_tiny_gguf

MODES = ("fp8", "int8", "int4")
HALF_STEP = {"int8": 0.5 / 127.5, "int4": 0.5 / 7.5, "fp8": 2.0**-4}  # relative to the range
SMALL = dict(
    dtype="float32",
    page_size=16,
    num_pages=48,
    max_num_seqs=4,
    max_num_batched_tokens=32,
    max_model_len=96,
    param_cache=False,
)
# Two prompts of one length (the logit checks feed prompt + output, one compile per model) and a
# long one whose prefill spans several chunks.
PROMPTS = [[5, 17, 33, 101, 7], [200, 2, 250, 9, 1], list(range(40, 70))]
NEW_TOKENS = 12
# The skinny-matmul kernel runs in interpret mode (about two seconds a decode step here): its
# engines decode the first few of those tokens, enough for every bucket (the long prompt's
# chunks, the decode steps) to run it.
KERNEL_TOKENS = 4
BF16 = dict(dtype="bfloat16")


@pytest.fixture(scope="module")
def lookup(tmp_path_factory) -> tuple[Path, np.ndarray]:
    path = tmp_path_factory.mktemp("lookup")
    return path, write_lookup_model(path)


@pytest.fixture(scope="module")
def engines(lookup) -> dict[str | None, LLM]:
    path, _ = lookup
    return {q: LLM(str(path), quantization=q, **SMALL) for q in (None, *MODES)}


@pytest.fixture(scope="module")
def models(lookup) -> dict:
    """The lookup model loaded in each mode, for running it directly (model_harness)."""
    path, _ = lookup
    return {q: _loaded(path, q) for q in (None, *MODES)}


@pytest.fixture(scope="module")
def greedy(engines) -> dict[str | None, list[list[int]]]:
    p = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    return {q: [o.token_ids for o in llm.generate(PROMPTS, p)] for q, llm in engines.items()}


def _loaded(path, quantization=None):
    return load_model(
        str(path),
        dtype="float32",
        mesh=make_mesh(MeshConfig()),
        param_cache=False,
        quantization=quantization,
    )


def test_float32_tokens_follow_the_quantized_lookup(lookup, greedy):
    """The premise: float32's tokens are perm[t], which only layer 0's MLP computes."""
    _, perm = lookup
    for prompt, out in zip(PROMPTS, greedy[None], strict=True):
        seq = [prompt[-1], *out]
        assert [perm[t] for t in seq[:-1]] == seq[1:]


@pytest.mark.parametrize("mode", MODES)
def test_greedy_tokens_equal_float32_with_zero_recompiles(mode, engines, greedy):
    assert greedy[mode] == greedy[None]
    assert engines[mode].engine.num_recompiles == 0
    # fp8 weights' programs compile with XLA's Triton GEMMs off (program_options.py)
    off = {"xla_gpu_enable_triton_gemm": False} if mode == "fp8" else {}
    assert engines[mode].engine.runner.compiler_options == off


def test_fp8_on_the_skinny_matmul_kernel(lookup, greedy):
    """quantized_matmul="pallas": every layer of the lookup model (multiples of 128 features) runs
    the kernel (interpret mode here) in every bucket, with float32's tokens and no recompile."""
    path, _ = lookup
    llm = LLM(str(path), quantization="fp8", quantized_matmul="pallas", **SMALL)
    _every_layer_on_the_kernel_gives_float32s_tokens(llm, jnp.float32, greedy)
    assert llm.get_metrics()["nori:model_config_info"]["quantized_matmul"] == "pallas"


def test_int4_on_the_skinny_matmul_kernel(lookup, greedy):
    """Group-wise int4 with bf16 activations (what the kernel takes: the weight converted in
    registers, each group's product scaled inside): every layer runs it in every bucket
    (interpret mode here), with float32's tokens and no recompile."""
    path, _ = lookup
    llm = LLM(str(path), quantization="int4", quantized_matmul="pallas", **SMALL | BF16)
    _every_layer_on_the_kernel_gives_float32s_tokens(llm, jnp.bfloat16, greedy)
    assert llm.get_metrics()["nori:model_config_info"]["quantized_matmul"] == "pallas"


def _every_layer_on_the_kernel_gives_float32s_tokens(llm, activation_dtype, greedy):
    loaded = llm.engine.model
    model = nnx.merge(loaded.graphdef, loaded.state)
    layers = [n for _, n in nnx.iter_graph(model) if hasattr(n, "small_matmul")]
    assert layers and all(n.small_matmul == "pallas" for n in layers)
    buckets = llm.engine.runner.buckets
    assert all(n._skinny(t, activation_dtype) for n in layers for t in buckets)
    p = SamplingParams(max_tokens=KERNEL_TOKENS, temperature=0.0, ignore_eos=True)
    want = [t[:KERNEL_TOKENS] for t in greedy[None]]
    assert [o.token_ids for o in llm.generate(PROMPTS, p)] == want
    assert llm.engine.num_recompiles == 0


@pytest.mark.parametrize("mode", MODES)
def test_logits_stay_within_two_half_steps(mode, models, greedy):
    ref, quant = models[None], models[mode]
    for prompt, out in zip(PROMPTS[:2], greedy[None], strict=False):
        ids = prompt + out
        lf, lq = PagedSequence(ref).feed(ids), PagedSequence(quant).feed(ids)
        tol = 2 * HALF_STEP[mode] * np.abs(lf).max()
        err = np.abs(lq - lf).max()
        assert 0 < err <= tol, (mode, err, tol)
        top2 = np.sort(lf[len(prompt) - 1 :], axis=-1)[:, -2:]
        assert (top2[:, 1] - top2[:, 0]).min() > 2 * tol  # so equal tokens are no accident


def test_finer_grids_err_less(models, greedy):
    ids = PROMPTS[0] + greedy[None][0]
    lf = PagedSequence(models[None]).feed(ids)
    err = {m: np.abs(PagedSequence(models[m]).feed(ids) - lf).max() for m in MODES}
    assert err["int8"] < err["fp8"] < err["int4"]


def _dequantized_checkpoint(loaded, path: Path) -> Path:
    """A float32 HF directory holding the quantized model's dequantized weights."""
    state = nnx.to_pure_dict(loaded.state)
    hf = {"model.embed_tokens.weight": state["embed_tokens"], "model.norm.weight": state["norm"]}
    hf["lm_head.weight"] = np.asarray(state["lm_head"]).T
    hf = {k: np.asarray(v["weight"] if isinstance(v, dict) else v) for k, v in hf.items()}
    for i, layer in state["layers"].items():
        p = f"model.layers.{i}."
        for part in ("self_attn", "mlp"):
            for name, leaves in layer[part].items():
                hf[f"{p}{part}.{name}.weight"] = np.asarray(
                    dequantize_leaves(leaves, loaded.quantization)
                )
        for norm in ("input_layernorm", "post_attention_layernorm"):
            hf[f"{p}{norm}.weight"] = np.asarray(layer[norm]["weight"])
    path.mkdir()
    save_file({k: np.ascontiguousarray(v, np.float32) for k, v in hf.items()}, path / "m.st")
    (path / "m.st").rename(path / "model.safetensors")
    return path


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_weight_only_modes_compute_the_dequantized_model(mode, lookup, models, tmp_path):
    path, _ = lookup
    quant = models[mode]
    deq = _dequantized_checkpoint(quant, tmp_path / "dequantized")
    (deq / "config.json").write_text((path / "config.json").read_text())
    ids = PROMPTS[0] + list(range(100, 112))
    lq, ld = PagedSequence(quant).feed(ids), PagedSequence(_loaded(deq)).feed(ids)
    np.testing.assert_allclose(lq, ld, rtol=1e-5, atol=1e-5)


def test_fp8_upcast_computes_the_dequantized_model(lookup, greedy, tmp_path, caplog):
    """quantized_matmul="upcast": fp8 layers in calls of up to 64 tokens (every bucket here)
    multiply the activations as they are by the fp8 weight converted (weight-only): the logits
    of a float32 model holding the dequantized weights, which fp8 x fp8 with its per-token
    activation scales does not give; float32's tokens, no recompile, and every forward pass
    compiled with XLA's Triton GEMMs (they convert the weight inside the GEMM)."""
    path, _ = lookup
    with caplog.at_level(logging.INFO, logger="nori_jax.engine"):
        llm = LLM(str(path), quantization="fp8", quantized_matmul="upcast", **SMALL)
    assert "calls of few tokens weight-only" in caplog.text
    p = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(PROMPTS, p)] == greedy[None]
    assert llm.engine.num_recompiles == 0
    assert llm.get_metrics()["nori:model_config_info"]["quantized_matmul"] == "upcast"
    runner = llm.engine.runner
    forwards = {n: o for n, o in runner.compiler_options_of.items() if n.startswith("bucket ")}
    assert len(forwards) == len(runner.buckets) and all(o == {} for o in forwards.values())
    assert runner.compiler_options == {"xla_gpu_enable_triton_gemm": False}  # the rest

    upcast = load_model(
        str(path),
        dtype="float32",
        mesh=make_mesh(MeshConfig()),
        param_cache=False,
        quantization="fp8",
        small_matmul="upcast",
    )
    assert upcast.small_matmul == "upcast"
    deq = _dequantized_checkpoint(upcast, tmp_path / "dequantized")
    (deq / "config.json").write_text((path / "config.json").read_text())
    ids = PROMPTS[0] + list(range(100, 112))  # 17 tokens: one call of few tokens
    ld = PagedSequence(_loaded(deq)).feed(ids)
    np.testing.assert_allclose(PagedSequence(upcast).feed(ids), ld, rtol=1e-5, atol=1e-5)
    fp8 = PagedSequence(_loaded(path, "fp8")).feed(ids)  # activations quantized too
    assert np.abs(fp8 - ld).max() > 1e-3 * np.abs(ld).max()


def test_upcast_leaves_other_modes_on_xla(lookup):
    """int8 / int4 are weight-only on XLA already: "upcast" changes nothing for them."""
    path, _ = lookup
    for mode in ("int8", "int4"):
        loaded = load_model(
            str(path),
            dtype="float32",
            mesh=make_mesh(MeshConfig()),
            param_cache=False,
            quantization=mode,
            small_matmul="upcast",
        )
        assert loaded.small_matmul == "xla"


def test_metrics_and_log_name_the_weights(lookup, engines, caplog):
    assert engines["int4"].get_metrics()["nori:model_config_info"] == {
        "dtype": "float32",
        "quantization": "int4",
        "weights": "int4 (int4, groups of 128; quantized at load)",
        "quantized_matmul": "xla",
        "kv_cache_dtype": "float32",
        "kv_scales": "none",
        "gpu_client": "none",  # no GPU: XLA's GPU runtimes do not apply
    }
    assert engines[None].get_metrics()["nori:model_config_info"]["quantization"] == "none"
    # fp8's calls of few tokens are weight-only by default (quantized_matmul="auto")
    assert engines["fp8"].get_metrics()["nori:model_config_info"]["quantized_matmul"] == "upcast"
    text = engines["fp8"].engine.metrics.registry
    from prometheus_client import generate_latest

    exposed = generate_latest(text).decode()
    assert 'quantization="fp8"' in next(
        line for line in exposed.splitlines() if line.startswith("nori:model_config_info")
    )
    path, _ = lookup
    with caplog.at_level(logging.INFO, logger="nori_jax.engine"):
        LLM(str(path), quantization="int8", **SMALL)
    assert "linear weights int8 (int8, per channel; quantized at load), float32 compute" in (
        caplog.text
    )


# ---- GGUF files whose blocks fit the mode ----------------------------------------------------


@pytest.mark.parametrize(
    ("qtype", "mode", "dtype", "offset"),
    [
        (Q.Q4_1, "int4", "int4", True),
        (Q.Q4_0, "int4", "int4", False),
        (Q.Q8_0, "int8", "int8", False),
    ],
)
def test_gguf_blocks_load_exactly(qtype, mode, dtype, offset, tmp_path):
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    write_tiny_gguf(path, qtype=qtype)
    ref, quant = _loaded(path), _loaded(path, mode)
    assert quant.quantization.group_size == 32 and quant.quantization.offset is offset
    qkv = quant.state["layers"][0]["self_attn"]["qkv_proj"]  # the file's q, k, v blocks fused
    assert qkv["qvalue"].get_value().dtype.name == dtype
    assert qkv["scale"].get_value().shape == (128, 2)  # [64 + 2 x 32 out, 64 in / 32]
    ids = [5, 17, 33, 101, 7, 250, 3, 3, 90]
    lf, lq = PagedSequence(ref).feed(ids), PagedSequence(quant).feed(ids)
    np.testing.assert_allclose(lq, lf, rtol=1e-5, atol=1e-5 * np.abs(lf).max())


def test_gguf_int4_engine_and_parameter_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NORI_JAX_PARAM_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny-q4_1.gguf"
    write_tiny_gguf(path, qtype=Q.Q4_1)
    kw = dict(SMALL, param_cache=True)
    p = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    float_tokens = [o.token_ids for o in LLM(str(path), **kw).generate(PROMPTS, p)]
    first = LLM(str(path), quantization="int4", **kw)
    again = LLM(str(path), quantization="int4", **kw)  # restored from the orbax cache
    assert not first.engine.model.from_cache and again.engine.model.from_cache
    for llm in (first, again):
        assert [o.token_ids for o in llm.generate(PROMPTS, p)] == float_tokens
        assert llm.engine.num_recompiles == 0

    def leaves(llm):
        return nnx.to_pure_dict(llm.engine.model.state)["layers"][1]["mlp"]["gate_up_proj"]

    for name in ("qvalue", "scale", "offset"):
        a, b = np.asarray(leaves(first)[name]), np.asarray(leaves(again)[name])
        assert a.dtype == b.dtype and np.array_equal(a.astype(np.float32), b.astype(np.float32))
    assert json.dumps(first.get_metrics()["nori:model_config_info"]).count("Q4_1 blocks, exact")
