"""The GGUF reader against gguf.GGUFReader, and dequantization against an independent decoder."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as Q
from tiny_gguf import write_tiny_gguf

from nori_jax.weights.gguf_file import read_gguf_file
from nori_jax.weights.gguf_tensors import SUPPORTED_TYPES, dequantize

# byte offsets of the float16 scale fields in each block (ggml's block_q* structs); the rest are
# packed quants and sub-block scales, for which any byte is valid
F16_FIELDS = {
    Q.Q4_0: (0,),
    Q.Q4_1: (0, 2),
    Q.Q5_0: (0,),
    Q.Q5_1: (0, 2),
    Q.Q8_0: (0,),
    Q.Q2_K: (80, 82),
    Q.Q3_K: (108,),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
}


def random_blocks(qtype: Q, rows: int, blocks_per_row: int, rng: np.random.Generator) -> np.ndarray:
    """Random but valid blocks: random bytes with sane float16 scales."""
    _, block_bytes = GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, size=(rows, blocks_per_row, block_bytes), dtype=np.uint8)
    for at in F16_FIELDS[qtype]:
        scales = rng.uniform(-0.1, 0.1, size=(rows, blocks_per_row)).astype(np.float16)
        data[..., at : at + 2] = scales.view(np.uint8).reshape(rows, blocks_per_row, 2)
    return data.reshape(rows, blocks_per_row * block_bytes)


def write_raw_tensors(
    path: Path, tensors: dict[str, tuple[np.ndarray, Q]], metadata: bool = False
) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    if metadata:  # one key of every value type, for the reader comparison
        writer.add_uint8("t.u8", 200)
        writer.add_int8("t.i8", -100)
        writer.add_uint16("t.u16", 60000)
        writer.add_int16("t.i16", -30000)
        writer.add_uint32("t.u32", 4_000_000_000)
        writer.add_int32("t.i32", -2_000_000_000)
        writer.add_float32("t.f32", 0.1)
        writer.add_uint64("t.u64", 2**63 + 5)
        writer.add_int64("t.i64", -(2**62))
        writer.add_float64("t.f64", 0.1)
        writer.add_bool("t.bool", True)
        writer.add_string("t.str", "héllo 😀")
        writer.add_array("t.ints", [1, -2, 3])
        writer.add_array("t.floats", [0.5, -1.25])
        writer.add_array("t.strs", ["a", "", "Ġb c"])
        writer.add_array("t.bools", [True, False])
        writer.add_array("t.empty", [])
    for name, (data, qtype) in tensors.items():
        if qtype in (Q.F32, Q.F16):
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_reader_matches_gguf_reader(tmp_path: Path):
    rng = np.random.default_rng(0)
    path = tmp_path / "all.gguf"
    tensors = {
        "a": (rng.standard_normal((3, 5)).astype(np.float32), Q.F32),
        "b": (rng.standard_normal((7,)).astype(np.float16), Q.F16),
        "c": (random_blocks(Q.Q4_1, 4, 2, rng), Q.Q4_1),
        "d": (random_blocks(Q.Q6_K, 2, 1, rng), Q.Q6_K),
    }
    write_raw_tensors(path, tensors, metadata=True)
    ours = read_gguf_file(path)
    ref = gguf.GGUFReader(str(path))
    ref_fields = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert ours.metadata == ref_fields
    assert ours.version == ref.fields["GGUF.version"].contents()
    assert list(ours.tensors) == [t.name for t in ref.tensors]
    for t in ref.tensors:
        info = ours.tensors[t.name]
        assert info.shape == tuple(int(d) for d in reversed(t.shape.tolist()))
        assert (info.ggml_type, info.offset, info.nbytes) == (
            t.tensor_type,
            t.data_offset,
            t.n_bytes,
        )
        assert ours.raw(info).tobytes() == np.ascontiguousarray(t.data).tobytes()


def test_reader_matches_gguf_reader_on_a_model_file(tmp_path: Path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, qtype=Q.Q8_0)
    ours = read_gguf_file(path)
    ref = gguf.GGUFReader(str(path))
    assert ours.metadata == {
        k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")
    }
    assert [(i.name, i.offset, i.nbytes) for i in ours.tensors.values()] == [
        (t.name, t.data_offset, t.n_bytes) for t in ref.tensors
    ]


@pytest.mark.parametrize("qtype", sorted(F16_FIELDS, key=int), ids=lambda t: t.name)
def test_dequantize_matches_an_independent_decoder(tmp_path: Path, qtype: Q):
    """gguf's numpy decoders (which we use) against transformers' separate torch decoders, on random
    blocks; Q5_0/Q5_1, which transformers lacks, are checked by a quantize round trip instead."""
    assert qtype in SUPPORTED_TYPES
    block, _ = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(int(qtype))
    raw = random_blocks(qtype, rows=6, blocks_per_row=2, rng=rng)
    path = tmp_path / "q.gguf"
    write_raw_tensors(path, {"w": (raw, qtype)})
    file = read_gguf_file(path)
    ours = dequantize(file, file.tensors["w"])
    assert ours.shape == (6, 2 * block) and ours.dtype == np.float32 and np.isfinite(ours).all()
    if qtype in (Q.Q5_0, Q.Q5_1):
        values = rng.standard_normal((6, 2 * block)).astype(np.float32)
        write_raw_tensors(path, {"w": (gguf.quants.quantize(values, qtype), qtype)})
        file = read_gguf_file(path)
        error = np.abs(dequantize(file, file.tensors["w"]) - values).max()
        assert error <= np.abs(values).max() / 15
        return
    import torch
    from transformers.integrations.gguf.dequant import dequantize as torch_dequantize

    ref = torch_dequantize(torch.from_numpy(raw.reshape(-1).copy()), int(qtype)).numpy()
    np.testing.assert_allclose(ours.reshape(-1), ref, rtol=1e-6, atol=1e-6)
