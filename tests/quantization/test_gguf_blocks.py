"""GGUF Q8_0 / Q4_0 / Q4_1 blocks as integers and scales, against the `gguf` package's reference
dequantization, and their mapping into the int8 / int4 layouts."""

from __future__ import annotations

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as Q

from nori_jax.quantization.quantize import dequantize_leaves
from nori_jax.weights.gguf_blocks import decode_blocks
from nori_jax.weights.gguf_quantized import blocks_to_tensor, gguf_scheme


def _fp16_bytes(x: float) -> list[int]:
    return list(np.array([x], np.float16).view(np.uint8))


def test_hand_made_q4_1_block():
    # d = 0.5, m = -1.0; byte j holds value j (low nibble) and value 16 + j (high nibble = 15 - j)
    nibbles = [j | ((15 - j) << 4) for j in range(16)]
    raw = np.array([_fp16_bytes(0.5) + _fp16_bytes(-1.0) + nibbles], np.uint8)
    b = decode_blocks(raw, Q.Q4_1)
    np.testing.assert_array_equal(b.q, [list(range(16)) + list(range(15, -1, -1))])
    np.testing.assert_array_equal(b.d, [[0.5]])
    np.testing.assert_array_equal(b.m, [[-1.0]])
    expected = 0.5 * np.array(list(range(16)) + list(range(15, -1, -1)), np.float32) - 1.0
    np.testing.assert_array_equal(b.dequantize(), [expected])
    np.testing.assert_array_equal(gguf.quants.dequantize(raw, Q.Q4_1), [expected])


def test_hand_made_q8_0_and_q4_0_blocks():
    q8 = np.arange(-16, 16, dtype=np.int8)
    raw8 = np.array([_fp16_bytes(0.25) + list(q8.view(np.uint8))], np.uint8)
    b8 = decode_blocks(raw8, Q.Q8_0)
    np.testing.assert_array_equal(b8.q, [q8])
    np.testing.assert_array_equal(b8.dequantize(), [0.25 * q8.astype(np.float32)])
    raw4 = np.array([_fp16_bytes(2.0) + [0x80 | 0x0F] * 16], np.uint8)  # low 15, high 8
    b4 = decode_blocks(raw4, Q.Q4_0)
    np.testing.assert_array_equal(b4.q, [[15] * 16 + [8] * 16])
    np.testing.assert_array_equal(b4.dequantize(), [[14.0] * 16 + [0.0] * 16])  # 2 * (q - 8)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_blocks_match_gguf_reference_bit_for_bit(qtype):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((6, 128)).astype(np.float32) * np.float32(3.0)
    raw = gguf.quants.quantize(w, qtype)
    b = decode_blocks(raw, qtype)
    assert b.q.shape == (6, 128) and b.d.shape == (6, 4)
    np.testing.assert_array_equal(b.dequantize(), gguf.quants.dequantize(raw, qtype))


@pytest.mark.parametrize(
    ("mode", "qtype", "stored_dtype", "offset"),
    [("int8", Q.Q8_0, jnp.int8, False), ("int4", Q.Q4_0, jnp.int4, False)],
)
def test_single_type_files_map_exactly(mode, qtype, stored_dtype, offset):
    rng = np.random.default_rng(2)
    raw = gguf.quants.quantize(rng.standard_normal((4, 96)).astype(np.float32), qtype)
    scheme, exact = gguf_scheme(mode, [qtype])
    assert exact and scheme.group_size == 32 and scheme.offset is offset
    t = blocks_to_tensor(decode_blocks(raw, qtype), scheme)
    assert t.qvalue.dtype == stored_dtype and t.offset is None
    back = np.asarray(dequantize_leaves(t.leaves(), scheme))
    np.testing.assert_array_equal(back, gguf.quants.dequantize(raw, qtype))


def test_q4_0_and_q4_1_files_map_with_offsets():
    rng = np.random.default_rng(3)
    raws = {
        t: gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), t)
        for t in (Q.Q4_0, Q.Q4_1)
    }
    scheme, exact = gguf_scheme("int4", raws)
    assert exact and scheme.offset and scheme.qtype == jnp.int4
    for qtype, raw in raws.items():
        t = blocks_to_tensor(decode_blocks(raw, qtype), scheme)
        assert t.qvalue.dtype == jnp.int4 and t.offset.shape == (4, 2)
        back = np.asarray(dequantize_leaves(t.leaves(), scheme))
        want = gguf.quants.dequantize(raw, qtype)
        if qtype == Q.Q4_0:  # offset 0: bit for bit
            np.testing.assert_array_equal(back, want)
        else:  # d (q - 8) + (m + 8 d): the offset is rounded once to float32
            np.testing.assert_allclose(back, want, rtol=0, atol=2 * np.spacing(np.abs(want)).max())
            assert np.abs(t.offset).min() > 0


@pytest.mark.parametrize(
    ("mode", "types", "group_size"),
    [
        ("int8", [Q.Q4_1], None),  # 4-bit values into int8: re-quantized per channel
        ("int4", [Q.Q8_0], 128),
        ("int4", [Q.Q4_1, Q.F16], 128),  # mixed: every tensor re-quantized alike
        ("int8", [Q.Q8_0, Q.Q6_K], None),
        ("fp8", [Q.Q8_0], None),
    ],
)
def test_other_files_are_quantized_from_float32(mode, types, group_size):
    scheme, exact = gguf_scheme(mode, types)
    assert not exact and scheme.group_size == group_size and not scheme.offset
    assert "dequantized to float32" in scheme.source
