"""Broken, truncated and unsupported GGUF files: a ValueError naming the file and the tensor."""

from __future__ import annotations

import re
import struct
from pathlib import Path

import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as Q
from tiny_gguf import TinyModel, write_tiny_gguf

from nori_jax.weights.gguf import load_gguf
from nori_jax.weights.gguf_file import read_gguf_file


def _raises(path: Path, *fragments: str) -> str:
    with pytest.raises(ValueError) as info:
        load_gguf(path)
    message = str(info.value)
    for fragment in (str(path), *fragments):
        assert fragment in message, message
    return message


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, qtype=Q.Q4_1)
    return path


def test_truncated_data_names_the_last_tensor(tiny: Path):
    last = list(read_gguf_file(tiny).tensors)[-1]
    data = tiny.read_bytes()
    tiny.write_bytes(data[:-100])
    _raises(tiny, "truncated", repr(last))


def test_truncated_header(tiny: Path):
    data = tiny.read_bytes()
    for cut in (30, 600, 5000):
        tiny.write_bytes(data[:cut])
        _raises(tiny, "truncated")


def test_not_a_gguf_file(tmp_path: Path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    _raises(path, "not a GGUF file")
    path.write_bytes(b"")
    _raises(path, "not a GGUF file")
    _raises(tmp_path / "missing.gguf", "not found")


def test_corrupt_string_length(tiny: Path):
    data = bytearray(tiny.read_bytes())
    at = data.index(b"general.architecture") - 8  # the key's u64 length
    data[at : at + 8] = struct.pack("<Q", 2**40)
    tiny.write_bytes(bytes(data))
    _raises(tiny, "truncated or corrupt", "metadata key #0")


def _patch_tensor_type(path: Path, name: str, type_id: int) -> None:
    """Rewrite the ggml type of tensor `name` in the file's tensor table."""
    data = bytearray(path.read_bytes())
    at = data.index(struct.pack("<Q", len(name)) + name.encode()) + 8 + len(name)
    (n_dims,) = struct.unpack_from("<I", data, at)
    data[at + 4 + 8 * n_dims : at + 8 + 8 * n_dims] = struct.pack("<I", type_id)
    path.write_bytes(bytes(data))


def test_unknown_type_id_names_the_tensor(tiny: Path):
    _patch_tensor_type(tiny, "blk.1.ffn_up.weight", 200)
    _raises(tiny, "'blk.1.ffn_up.weight'", "unknown ggml type id 200")


@pytest.mark.parametrize("qtype", [Q.IQ2_XXS, Q.IQ4_NL, Q.TQ2_0], ids=lambda t: t.name)
def test_unsupported_type_names_the_tensor_and_type(tmp_path: Path, qtype: Q):
    path = tmp_path / "iq.gguf"
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    m = TinyModel(hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=256)
    raw = np.zeros((m.hidden, m.intermediate // block * block_bytes), dtype=np.uint8)
    write_tiny_gguf(
        path,
        m,
        extra_tensors={"blk.0.ffn_down.weight": (raw, qtype)},
        skip=("blk.0.ffn_down.weight",),
    )
    message = _raises(path, "'blk.0.ffn_down.weight'", qtype.name, "not supported")
    assert "Q4_K" in message  # lists what is supported


def test_unknown_tensor_is_refused(tmp_path: Path):
    path = tmp_path / "extra.gguf"
    extra = {"blk.0.attn_q_norm.weight": (np.ones(16, np.float32), Q.F32)}
    write_tiny_gguf(path, extra_tensors=extra)
    _raises(path, "'blk.0.attn_q_norm.weight'", "no place")


def test_missing_tensor(tmp_path: Path):
    path = tmp_path / "missing.gguf"
    write_tiny_gguf(path, skip=("blk.1.ffn_gate.weight",))
    _raises(path, "model.layers.1.mlp.gate_proj.weight", "missing")


def test_wrong_shape(tmp_path: Path):
    path = tmp_path / "shape.gguf"
    extra = {"blk.0.ffn_up.weight": (np.zeros((96, 64), np.float32), Q.F32)}
    write_tiny_gguf(path, extra_tensors=extra, skip=("blk.0.ffn_up.weight",))
    _raises(path, "'blk.0.ffn_up.weight'", "(96, 64)", "(128, 64)")


def test_unsupported_architecture_and_pre_tokenizer(tmp_path: Path):
    path = tmp_path / "arch.gguf"
    write_tiny_gguf(path, TinyModel(arch="phi3"))
    _raises(path, "'phi3'", "not supported")
    write_tiny_gguf(path, pre="some-new-model")
    _raises(path, "'some-new-model'", "not known")


def test_missing_hyperparameter(tmp_path: Path):
    path = tmp_path / "hp.gguf"
    write_tiny_gguf(path)
    data = path.read_bytes()
    # rename the key so it is no longer found (same length keeps the file valid)
    key = b"llama.feed_forward_length"
    path.write_bytes(data.replace(key, b"llama.feed_forward_lengtX"))
    _raises(path, "'llama.feed_forward_length'", "missing")


def test_error_messages_are_single_line(tiny: Path):
    tiny.write_bytes(tiny.read_bytes()[:-10])
    message = _raises(tiny)
    assert not re.search(r"\n", message)
