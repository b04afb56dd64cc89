"""The fused q/k/v and gate/up layout (models/fused_layout.py): exact rows on hand-made tensors, a
round trip through the device-side split, the column split giving each device its own heads, and
the loader's errors for parts that are missing or do not fit."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from nori_jax.executor.mesh import make_mesh
from nori_jax.mesh_config import MeshConfig
from nori_jax.model_config import ModelConfig, load_preset
from nori_jax.models.fused_layout import fuse_gate_up, fuse_qkv, split_gate_up, split_qkv
from nori_jax.quantization.quantize import QuantizedTensor
from nori_jax.weights.loader import abstract_model, place_tensors


def _rows(tag: int, n: int, width: int = 3) -> np.ndarray:
    """n rows whose values name them: row r of tensor `tag` holds tag * 100 + r."""
    return np.repeat((tag * 100 + np.arange(n, dtype=np.float32))[:, None], width, axis=1)


def test_qkv_rows_are_grouped_by_kv_head():
    # 4 q heads, 2 kv heads, head_dim 2: kv head 0 owns q heads 0-1, kv head 1 q heads 2-3
    q, k, v = _rows(1, 8), _rows(2, 4), _rows(3, 4)
    fused = fuse_qkv(q, k, v, num_kv_heads=2)
    want = [100, 101, 102, 103, 200, 201, 300, 301, 104, 105, 106, 107, 202, 203, 302, 303]
    np.testing.assert_array_equal(fused[:, 0], want)
    # biases ([out]) and a quantized weight's scales ([out, groups]) fuse the same way
    np.testing.assert_array_equal(fuse_qkv(q[:, 0], k[:, 0], v[:, 0], 2), want)


def test_gate_up_rows_alternate():
    fused = fuse_gate_up(_rows(1, 3), _rows(2, 3))
    np.testing.assert_array_equal(fused[:, 0], [100, 200, 101, 201, 102, 202])


@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (9, 3), (4, 4), (8, 1)])
def test_the_split_inverts_the_fusion(heads, kv_heads):
    d, hidden, t = 4, 6, 5
    rng = np.random.default_rng(heads)
    x = rng.standard_normal((t, hidden)).astype(np.float32)
    wq, wk, wv = (rng.standard_normal((n * d, hidden)).astype(np.float32)
                  for n in (heads, kv_heads, kv_heads))  # fmt: skip
    y = jnp.asarray(x) @ jnp.asarray(fuse_qkv(wq, wk, wv, kv_heads)).T
    q, k, v = split_qkv(y, heads, kv_heads, d)
    np.testing.assert_allclose(q, (x @ wq.T).reshape(t, heads, d), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(k, (x @ wk.T).reshape(t, kv_heads, d), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(v, (x @ wv.T).reshape(t, kv_heads, d), rtol=1e-5, atol=1e-5)
    wg, wu = rng.standard_normal((2, 7, hidden)).astype(np.float32)
    gate, up = split_gate_up(jnp.asarray(x) @ jnp.asarray(fuse_gate_up(wg, wu)).T)
    np.testing.assert_allclose(gate, x @ wg.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(up, x @ wu.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_a_column_split_gives_each_device_whole_kv_head_groups(tp):
    # 8 q heads over 4 kv heads: device i of tp holds kv heads [i * 4/tp, (i+1) * 4/tp) with
    # their q heads, k and v, whatever tp is (so one stored layout serves every mesh)
    heads, kv_heads, d = 8, 4, 1
    fused = fuse_qkv(_rows(1, heads * d, 1), _rows(2, kv_heads * d, 1), _rows(3, kv_heads * d, 1),
                     kv_heads)[:, 0]  # fmt: skip
    for i, shard in enumerate(np.split(fused, tp)):
        kvs = range(i * kv_heads // tp, (i + 1) * kv_heads // tp)
        want = [x for h in kvs for x in (100 + 2 * h, 101 + 2 * h, 200 + h, 300 + h)]
        np.testing.assert_array_equal(shard, want)


def _tiny_tensors(cfg: ModelConfig, drop: str | None = None, quantized=False):
    rng = np.random.default_rng(0)
    h, f, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    shapes = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
              "self_attn.q_proj.weight": (cfg.num_heads * d, h),
              "self_attn.k_proj.weight": (cfg.num_kv_heads * d, h),
              "self_attn.v_proj.weight": (cfg.num_kv_heads * d, h),
              "self_attn.o_proj.weight": (h, cfg.num_heads * d),
              "mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h),
              "mlp.down_proj.weight": (h, f)}  # fmt: skip
    embed = rng.standard_normal((cfg.vocab_size, h))
    out = [("model.embed_tokens.weight", embed), ("model.norm.weight", np.ones(h)),
           ("lm_head.weight", embed.copy())]  # fmt: skip
    for i in range(cfg.num_layers):
        for name, shape in shapes.items():
            full = f"model.layers.{i}.{name}"
            if full == drop:
                continue
            array = rng.standard_normal(shape).astype(np.float32)
            if quantized and name == "mlp.up_proj.weight":
                array = QuantizedTensor(array.astype(np.int8), np.ones((shape[0], 1), np.float32))
            out.append((full, array))
    return out


def _place(tensors):
    cfg = ModelConfig.from_hf_dict(load_preset("tiny-llama"))
    mesh = make_mesh(MeshConfig())
    _, abstract = abstract_model(cfg, jnp.float32, "reference", None, mesh)
    return place_tensors(tensors, abstract, mesh, "tiny", num_kv_heads=cfg.num_kv_heads)


def test_the_loader_fuses_the_checkpoints_parts():
    cfg = ModelConfig.from_hf_dict(load_preset("tiny-llama"))
    tensors = _tiny_tensors(cfg)
    state = _place(tensors)
    got = dict(tensors)
    layer = state["layers"][1]
    want_qkv = fuse_qkv(*(got[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"), 2)
    np.testing.assert_array_equal(
        np.asarray(layer["self_attn"]["qkv_proj"].get_value()), want_qkv.T
    )
    want_gu = fuse_gate_up(
        got["model.layers.1.mlp.gate_proj.weight"], got["model.layers.1.mlp.up_proj.weight"]
    )
    np.testing.assert_array_equal(np.asarray(layer["mlp"]["gate_up_proj"].get_value()), want_gu.T)


def test_a_missing_part_is_named():
    cfg = ModelConfig.from_hf_dict(load_preset("tiny-llama"))
    with pytest.raises(
        ValueError,
        match=r"lacks tensors for \['model.layers.1.self_attn.k_proj.weight'\] "
        r"\(of 'model.layers.1.self_attn.qkv_proj.weight'\)",
    ):
        _place(_tiny_tensors(cfg, drop="model.layers.1.self_attn.k_proj.weight"))


def test_parts_that_do_not_fuse_are_named():
    cfg = ModelConfig.from_hf_dict(load_preset("tiny-llama"))
    tensors = _tiny_tensors(cfg)
    bad = [(n, a[:-1] if n == "model.layers.0.mlp.up_proj.weight" else a) for n, a in tensors]
    with pytest.raises(
        ValueError,
        match=r"have shapes \[\(128, 64\), \(127, 64\)\], which do not fuse into "
        r"'model.layers.0.mlp.gate_up_proj.weight'",
    ):
        _place(bad)
    with pytest.raises(ValueError, match=r"mix quantized and float tensors"):
        _place(_tiny_tensors(cfg, quantized=True))
