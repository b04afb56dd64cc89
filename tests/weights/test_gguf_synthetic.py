"""Tiny synthetic GGUF files: each supported type, llama and qwen2, rope scaling, tokenizer."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as Q
from tiny_gguf import CHAT_TEMPLATE, TOKENS, TinyModel, write_tiny_gguf

from nori_jax.weights.gguf import load_gguf

# worst-case dequantization error as a fraction of the tensor's largest magnitude
TOLERANCE = {
    Q.F32: 0.0,
    Q.F16: 1e-3,
    Q.BF16: 8e-3,
    Q.Q8_0: 1 / 127,
    Q.Q5_0: 1 / 15,
    Q.Q5_1: 1 / 30,
    Q.Q4_0: 1 / 7,
    Q.Q4_1: 1 / 14,
}


@pytest.mark.parametrize("qtype", list(TOLERANCE), ids=lambda t: t.name)
def test_each_type_loads_to_the_written_values(tmp_path: Path, qtype: Q):
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    written = write_tiny_gguf(path, qtype=qtype)
    ckpt = load_gguf(path)
    loaded = dict(ckpt.tensors())
    assert loaded.keys() == written.keys()
    assert ckpt.tensor_shapes() == {k: v.shape for k, v in written.items()}
    for name, want in written.items():
        got = loaded[name]
        assert got.dtype == np.float32 and got.shape == want.shape, name
        bound = TOLERANCE[qtype if want.ndim == 2 else Q.F32] * np.abs(want).max()
        if qtype == Q.F32 or want.ndim == 1:
            np.testing.assert_array_equal(got, want, err_msg=name)  # exact: also pins the q/k order
        else:
            assert np.abs(got - want).max() <= bound, name


@pytest.mark.parametrize(
    "model",
    [
        TinyModel(arch="llama", tie=False),
        # head_dim from attention.key_length, not hidden / heads
        TinyModel(arch="llama", tie=True, heads=2, kv_heads=1, head_dim=32),
        TinyModel(arch="qwen2", tie=True, bias=True, kv_heads=1),
    ],
    ids=["llama", "llama-tied-mqa", "qwen2-bias"],
)
def test_matches_transformers_on_the_same_file(tmp_path: Path, model: TinyModel):
    """transformers' own GGUF loader agrees on names, layout (q/k order), biases and config."""
    import torch
    import transformers

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, model, qtype=Q.Q8_0, pre="qwen2" if model.arch == "qwen2" else "smollm")
    ckpt = load_gguf(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32
    )
    ref = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    tied = {"lm_head.weight"} if model.tie else set()
    assert set(ckpt.tensor_names()) == set(ref) - tied
    for name, array in ckpt.tensors():
        np.testing.assert_array_equal(array, ref[name], err_msg=name)
    cfg = ckpt.hf_config
    assert cfg["model_type"] == hf.config.model_type == model.arch
    for key in ["num_attention_heads", "num_key_value_heads", "hidden_size", "tie_word_embeddings"]:
        assert cfg[key] == getattr(hf.config, key), key
    assert cfg["head_dim"] == model.head_dim
    assert cfg["attention_bias"] == model.bias


def test_qwen2_is_not_unpermuted(tmp_path: Path):
    path = tmp_path / "qwen2.gguf"
    written = write_tiny_gguf(path, TinyModel(arch="qwen2", bias=True), pre="qwen2")
    ckpt = load_gguf(path)
    for name in ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.bias"]:
        np.testing.assert_array_equal(ckpt.tensor(name), written[name])
    assert ckpt.hf_config["model_type"] == "qwen2" and ckpt.hf_config["attention_bias"]


def test_mixed_types_in_one_file(tmp_path: Path):
    """A Q4_K_M-style mix: embeddings Q8_0, attention F16, MLP Q4_0, one layer BF16."""
    path = tmp_path / "mixed.gguf"
    types = {
        "token_embd.weight": Q.Q8_0,
        "blk.0.attn_q.weight": Q.F16,
        "blk.1.ffn_down.weight": Q.BF16,
    }
    written = write_tiny_gguf(path, qtype=Q.Q4_0, types=types)
    ckpt = load_gguf(path)
    assert {i.type_name for i in ckpt.file.tensors.values()} == {
        "Q8_0",
        "F16",
        "BF16",
        "Q4_0",
        "F32",
    }
    got = ckpt.tensor("model.layers.0.self_attn.q_proj.weight")
    np.testing.assert_allclose(got, written["model.layers.0.self_attn.q_proj.weight"], rtol=1e-3)


def _hf_inv_freq(rope_scaling: dict | None, theta: float, head_dim: int) -> np.ndarray:
    """transformers' rotary inverse frequencies for these rope parameters."""
    import torch
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_scaling is None:  # HF's default rope, as LlamaRotaryEmbedding computes it
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return (1.0 / theta**exponents).numpy()
    config = LlamaConfig(
        hidden_size=head_dim * 2,
        num_attention_heads=2,
        head_dim=head_dim,
        rope_theta=theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=131072,
    )
    return ROPE_INIT_FUNCTIONS[rope_scaling["rope_type"]](config, "cpu")[0].numpy()


@pytest.mark.parametrize(
    "params",
    [
        {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original": 8192},  # 3.1
        {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original": 8192},  # 3.2
        # not Llama 3's values: fitted from the tensor
        {"factor": 4.0, "low_freq_factor": 2.0, "high_freq_factor": 6.0, "original": 4096},
    ],
)
def test_llama3_rope_freqs_become_rope_scaling(tmp_path: Path, params: dict):
    """llama.cpp stores Llama 3's rope scaling as a `rope_freqs` tensor; the config must give HF's
    llama3 rope the same frequencies."""
    import transformers  # noqa: F401

    theta, head_dim = 500000.0, 64
    hf_scaling = {
        "rope_type": "llama3",
        "factor": params["factor"],
        "low_freq_factor": params["low_freq_factor"],
        "high_freq_factor": params["high_freq_factor"],
        "original_max_position_embeddings": params["original"],
    }
    plain = _hf_inv_freq(None, theta, head_dim)
    scaled = _hf_inv_freq(hf_scaling, theta, head_dim)
    rope_freqs = (plain / scaled).astype(np.float32)  # what llama.cpp's converter writes
    path = tmp_path / "llama3.gguf"
    model = TinyModel(hidden=128, heads=2, kv_heads=1, head_dim=64, rope_theta=theta)
    write_tiny_gguf(path, model, extra_tensors={"rope_freqs.weight": (rope_freqs, Q.F32)})
    ckpt = load_gguf(path)
    scaling = ckpt.hf_config["rope_scaling"]
    assert scaling["rope_type"] == "llama3" and scaling["factor"] == params["factor"]
    np.testing.assert_allclose(_hf_inv_freq(scaling, theta, head_dim), scaled, rtol=1e-5)
    assert "rope_freqs.weight" not in str(ckpt.tensor_names())


def test_linear_and_yarn_rope_scaling(tmp_path: Path):
    path = tmp_path / "linear.gguf"
    write_tiny_gguf(
        path, extra_metadata={"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0}
    )
    assert load_gguf(path).hf_config["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    path = tmp_path / "yarn.gguf"
    yarn = {
        "llama.rope.scaling.type": "yarn",
        "llama.rope.scaling.factor": 4.0,
        "llama.rope.scaling.original_context_length": 32768,
    }
    write_tiny_gguf(path, extra_metadata=yarn)
    assert load_gguf(path).hf_config["rope_scaling"] == {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 32768,
    }


@pytest.mark.parametrize(
    ("pre", "add_bos"),
    [("smollm", True), ("smollm", False), ("smollm", None), ("qwen2", False), ("llama-bpe", True)],
)
def test_tokenizer_matches_transformers(tmp_path: Path, pre: str, add_bos: bool | None):
    import transformers

    path = tmp_path / "tok.gguf"
    write_tiny_gguf(path, pre=pre, add_bos=add_bos)
    tok = load_gguf(path).tokenizer
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    texts = [
        "hello world",
        " the hello",
        "<|im_start|>hello<|im_end|>",
        "a<think>b",
        "héllo 😀 it's",
        "hello\n\n  world  \t",
        "",
    ]
    for text in texts:
        for special in (True, False):
            want = ref(text, add_special_tokens=special)["input_ids"]
            assert tok.encode(text, special) == want, text
    assert tok.encode("hello")[:1] == ([1] if add_bos else [TOKENS.index("hello")])
    assert tok.encode("x<think>y", add_special_tokens=False)[1] == TOKENS.index("<think>")
    assert tok.decode(tok.encode("a<think>b<|im_end|>"), skip_special_tokens=True) == "a<think>b"
    messages = [{"role": "user", "content": "hello"}]
    assert tok.chat_template == CHAT_TEMPLATE
    want = ref.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert tok.encode_chat(messages) == list(want)


def test_llama3_pre_tokenizer_ignores_merges_and_adds_bos(tmp_path: Path):
    """As Llama 3's tokenizer.json and llama.cpp: a pre-token that is a token is taken whole, and
    BOS is added by default (the file has no add_bos_token here)."""
    path = tmp_path / "llama3.gguf"
    write_tiny_gguf(path, pre="llama-bpe", add_bos=None)
    tok = load_gguf(path).tokenizer
    assert tok.encode("a xyz") == [1, TOKENS.index("a"), TOKENS.index("Ġxyz")]
    path = tmp_path / "gpt2.gguf"
    write_tiny_gguf(path, pre="default", add_bos=None)
    ids = load_gguf(path).tokenizer.encode("a xyz")
    assert ids == [TOKENS.index(c) for c in ["a", "Ġ", "x", "y", "z"]]


def test_chat_template_features(tmp_path: Path):
    """Globals transformers provides to templates: strftime_now, raise_exception, tojson."""
    path = tmp_path / "tok.gguf"
    write_tiny_gguf(path)
    tok = load_gguf(path).tokenizer
    tok.chat_template = (
        "{{ strftime_now('%Y') }}|{{ messages[0] | tojson }}|{{ tools | tojson }}|{{ flag }}"
        "{% if messages | length > 1 %}{{ raise_exception('one message only') }}{% endif %}"
    )
    out = tok.apply_chat_template(
        [{"role": "user", "content": "<é>", "tool_calls": None}], tools=[{"a": 1}], flag=True
    )
    year = out.split("|")[0]
    assert year.isdigit() and math.isclose(int(year), 2026, abs_tol=100)
    assert out.endswith('|{"role": "user", "content": "<é>"}|[{"a": 1}]|True')
    with pytest.raises(ValueError, match="one message only"):
        tok.apply_chat_template([{"role": "user", "content": "a"}] * 2)
