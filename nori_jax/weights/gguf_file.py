"""Reading a GGUF container: its metadata, its tensor table, and each tensor's raw bytes.

The `gguf` package's `GGUFReader` is the format's reference reader, but it walks every element of
the vocabulary and merge arrays through numpy views: ~7 s for SmolLM2's 49k-token vocabulary. This
reader parses the same layout with `struct` in ~0.2 s and checks every length and offset against
the file size as it goes, so a corrupt or truncated file gives a ValueError naming the file and the
field or tensor, never a numpy reshape error. Type ids, block sizes and the magic number come from
`gguf.constants`; tests check it field for field against `GGUFReader`.

Layout (GGUF v2/v3, little-endian): magic, u32 version, u64 tensor count, u64 metadata count, the
metadata key/value pairs, the tensor table (name, dims innermost first, ggml type, offset), padding
to `general.alignment`, then the tensor data.
"""

from __future__ import annotations

import dataclasses
import math
import struct
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import (
    GGML_QUANT_SIZES,
    GGUF_DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    GGMLQuantizationType,
    GGUFValueType,
)

_SUPPORTED_VERSIONS = (2, 3)  # v1 counted in u32 and predates every model worth loading
_MAX_DIMS = 4  # GGML_MAX_DIMS

# scalar value types: struct format and numpy dtype (little-endian)
_SCALARS: dict[int, tuple[str, str]] = {
    GGUFValueType.UINT8: ("<B", "<u1"),
    GGUFValueType.INT8: ("<b", "<i1"),
    GGUFValueType.UINT16: ("<H", "<u2"),
    GGUFValueType.INT16: ("<h", "<i2"),
    GGUFValueType.UINT32: ("<I", "<u4"),
    GGUFValueType.INT32: ("<i", "<i4"),
    GGUFValueType.FLOAT32: ("<f", "<f4"),
    GGUFValueType.BOOL: ("<?", "<u1"),
    GGUFValueType.UINT64: ("<Q", "<u8"),
    GGUFValueType.INT64: ("<q", "<i8"),
    GGUFValueType.FLOAT64: ("<d", "<f8"),
}


@dataclasses.dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order, outermost first: ggml's `ne` reversed, e.g. [out, in]
    ggml_type: GGMLQuantizationType
    offset: int  # absolute byte offset of the data in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return self.ggml_type.name


@dataclasses.dataclass(frozen=True, eq=False)  # identity: holds a memmap
class GGUFFile:
    """A parsed GGUF file. Tensor data stays on disk (memory-mapped) until `raw()` is sliced."""

    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensorInfo]  # in file order
    _data: np.ndarray = dataclasses.field(repr=False)  # uint8 memmap of the whole file

    def raw(self, info: GGUFTensorInfo) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 view, shaped [*shape[:-1], bytes_per_row]."""
        block, type_size = GGML_QUANT_SIZES[info.ggml_type]
        row_bytes = info.shape[-1] // block * type_size
        return self._data[info.offset : info.offset + info.nbytes].reshape(
            *info.shape[:-1], row_bytes
        )


def read_gguf_file(path: str | Path) -> GGUFFile:
    """Parse the header and tensor table of the GGUF file at `path`; ValueError if malformed."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"GGUF file not found: {str(path)!r}")
    size = path.stat().st_size
    if size < 24:
        raise ValueError(
            f"{str(path)!r} is not a GGUF file: only {size} bytes, shorter than a header"
        )
    data = np.memmap(path, mode="r", dtype=np.uint8)
    cur = _Cursor(memoryview(data), str(path))

    (magic,) = struct.unpack_from("<I", cur.buf, 0)
    if magic != GGUF_MAGIC:
        raise ValueError(f"{str(path)!r} is not a GGUF file: it starts with {bytes(cur.buf[:4])!r}")
    cur.pos = 4
    version = cur.scalar(GGUFValueType.UINT32, "the version")
    if version not in _SUPPORTED_VERSIONS:
        if version & 0xFFFF == 0:  # a byte-swapped small number
            raise ValueError(
                f"{str(path)!r} is a big-endian GGUF file; only little-endian is supported"
            )
        raise ValueError(f"{str(path)!r} is GGUF v{version}; supported: {_SUPPORTED_VERSIONS}")
    tensor_count = cur.scalar(GGUFValueType.UINT64, "the tensor count")
    kv_count = cur.scalar(GGUFValueType.UINT64, "the metadata count")

    metadata: dict[str, Any] = {}
    for i in range(kv_count):
        key = cur.string(f"metadata key #{i}")
        value_type = cur.scalar(GGUFValueType.UINT32, f"the type of metadata {key!r}")
        if key in metadata:
            raise ValueError(
                f"{str(path)!r}: metadata key {key!r} appears twice; the file is corrupt"
            )
        metadata[key] = cur.value(value_type, f"metadata {key!r}")

    raw_infos = []
    for i in range(tensor_count):
        name = cur.string(f"the name of tensor #{i}")
        what = f"tensor {name!r}"
        n_dims = cur.scalar(GGUFValueType.UINT32, f"the rank of {what}")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise ValueError(f"{str(path)!r}: {what} has {n_dims=}; the file is corrupt")
        dims = [cur.scalar(GGUFValueType.UINT64, f"the shape of {what}") for _ in range(n_dims)]
        type_id = cur.scalar(GGUFValueType.UINT32, f"the type of {what}")
        rel_offset = cur.scalar(GGUFValueType.UINT64, f"the offset of {what}")
        raw_infos.append((name, tuple(reversed(dims)), type_id, rel_offset))

    alignment = metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"{str(path)!r}: general.alignment={alignment!r} is not a power of two")
    data_start = -(-cur.pos // alignment) * alignment

    tensors: dict[str, GGUFTensorInfo] = {}
    for name, shape, type_id, rel_offset in raw_infos:
        info = _tensor_info(str(path), name, shape, type_id, data_start, rel_offset, alignment)
        if name in tensors:
            raise ValueError(f"{str(path)!r}: tensor {name!r} appears twice; the file is corrupt")
        if info.offset + info.nbytes > size:
            raise ValueError(
                f"{str(path)!r} is truncated: tensor {name!r} ({info.type_name}, shape {shape}) "
                f"needs bytes [{info.offset}, {info.offset + info.nbytes}) but the file has "
                f"{size} bytes"
            )
        tensors[name] = info
    return GGUFFile(path, version, metadata, tensors, data)


def _tensor_info(
    path: str,
    name: str,
    shape: tuple[int, ...],
    type_id: int,
    data_start: int,
    rel_offset: int,
    alignment: int,
) -> GGUFTensorInfo:
    try:
        ggml_type = GGMLQuantizationType(type_id)
    except ValueError:
        raise ValueError(
            f"{path!r}: tensor {name!r} has an unknown ggml type id {type_id}"
        ) from None
    block, type_size = GGML_QUANT_SIZES[ggml_type]
    if shape[-1] % block:
        raise ValueError(
            f"{path!r}: tensor {name!r} has rows of {shape[-1]} values, not a multiple of the "
            f"{ggml_type.name} block of {block}; the file is corrupt"
        )
    if rel_offset % alignment:
        raise ValueError(
            f"{path!r}: tensor {name!r} has {rel_offset=}, not a multiple of {alignment=}"
        )
    nbytes = math.prod(shape) // block * type_size
    return GGUFTensorInfo(name, shape, ggml_type, data_start + rel_offset, nbytes)


class _Cursor:
    """A read position in the file; reads are bounds-checked so truncation names what was cut."""

    def __init__(self, buf: memoryview, path: str):
        self.buf = buf
        self.path = path
        self.pos = 0

    def _need(self, n: int, what: str) -> None:
        if self.pos + n > len(self.buf):
            raise ValueError(
                f"{self.path!r} is truncated or corrupt: reading {what} needs {n} bytes at offset "
                f"{self.pos}, but the file has {len(self.buf)} bytes"
            )

    def scalar(self, value_type: int, what: str) -> Any:
        fmt = _SCALARS[value_type][0]
        n = struct.calcsize(fmt)
        self._need(n, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return value

    def string(self, what: str) -> str:
        n = self.scalar(GGUFValueType.UINT64, what)
        self._need(n, what)
        try:
            text = str(self.buf[self.pos : self.pos + n], "utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{self.path!r}: {what} is not valid UTF-8 ({e})") from None
        self.pos += n
        return text

    def value(self, value_type: int, what: str) -> Any:
        if value_type in _SCALARS:
            return self.scalar(value_type, what)
        if value_type == GGUFValueType.STRING:
            return self.string(what)
        if value_type != GGUFValueType.ARRAY:
            raise ValueError(f"{self.path!r}: {what} has an unknown value type {value_type}")
        item_type = self.scalar(GGUFValueType.UINT32, what)
        count = self.scalar(GGUFValueType.UINT64, what)
        if item_type in _SCALARS:
            dtype = np.dtype(_SCALARS[item_type][1])
            self._need(count * dtype.itemsize, what)
            items = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
            self.pos += count * dtype.itemsize
            if item_type == GGUFValueType.BOOL:
                items = items.astype(bool)
            return items.tolist()
        # strings (a vocabulary) or nested arrays: each item is at least an 8-byte length, which
        # bounds the loop by the file size even when `count` is garbage
        self._need(count * 8, what)
        return [self.value(item_type, what) for _ in range(count)]
