"""A JSONL file as a grain data source: one record per line, read at its offset on demand.

    source = JsonlSource("requests.jsonl")          # one pass to index the line offsets
    ds = jsonl_dataset(source, ShardOptions(0, 2))   # this process's half, every 2nd line
    for position, line in ds.to_iter_dataset(ReadOptions(num_threads=2, prefetch_buffer_size=64)):
        ...

The index holds three int64 numbers per line (offset, length, line number: 24 bytes a line),
never the lines: a line is read with
`os.pread` when grain asks for it, so memory is bounded by grain's read-ahead
(`ReadOptions.prefetch_buffer_size`), not by the file. Blank lines are not records. Sharding is
grain's `ShardOptions` (or `ShardByJaxProcess`): shard i of n takes lines i, i+n, i+2n, ..., so
n processes split one file with no overlap. grain is imported only by `jsonl_dataset`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import grain

_INDEX_CHUNK = 16 * 2**20  # bytes read at a time while indexing
_DIGEST_SPAN = 2**20  # bytes of the head and of the tail that identify the file's content


@dataclasses.dataclass(frozen=True)
class JsonlLine:
    index: int  # the line's number in the file (0-based, blank lines counted)
    data: bytes | None  # the line without its newline; None when longer than max_line_bytes
    size: int  # the line's length in bytes


def index_lines(path: str) -> tuple[np.ndarray, np.ndarray]:
    """(start offset, length without the newline) of every line, int64 each; a last line without
    its newline counts."""
    ends = []
    with open(path, "rb") as f:
        base = 0
        while chunk := f.read(_INDEX_CHUNK):
            ends.append(np.flatnonzero(np.frombuffer(chunk, np.uint8) == ord("\n")) + base)
            base += len(chunk)
    newlines = np.concatenate(ends) if ends else np.zeros(0, np.int64)
    if base and (not len(newlines) or newlines[-1] != base - 1):
        newlines = np.append(newlines, base)  # a last line without its newline
    starts = np.concatenate([[0], newlines[:-1] + 1]).astype(np.int64)
    return starts[: len(newlines)], (newlines - starts[: len(newlines)]).astype(np.int64)


class JsonlSource:
    """grain `RandomAccessDataSource` over a JSONL file's non-blank lines (a `JsonlLine` each).

    Thread-safe (grain reads with several threads: `os.pread` moves no shared file position) and
    picklable (the descriptor is reopened after unpickling) for grain's worker processes.
    """

    def __init__(self, path: str | os.PathLike, max_line_bytes: int | None = None):
        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise ValueError(f"input {self.path!r} is not a file")
        if max_line_bytes is not None and max_line_bytes < 1:
            raise ValueError(f"max_line_bytes={max_line_bytes} must be >= 1")
        self.max_line_bytes = max_line_bytes
        self.size = os.path.getsize(self.path)
        starts, lengths = index_lines(self.path)
        # A line of only "\r" or nothing is blank; so is one of spaces only, which is rare
        # enough to leave to the reader (it reads as a line that is not JSON).
        blank = (lengths == 0) | ((lengths == 1) & self._is_cr(starts, lengths))
        self._line_numbers = np.flatnonzero(~blank).astype(np.int64)
        self._starts, self._lengths = starts[~blank], lengths[~blank]
        self._fd: int | None = None
        self._lock = threading.Lock()

    def _is_cr(self, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        out = np.zeros(len(starts), bool)
        with open(self.path, "rb") as f:
            for i in np.flatnonzero(lengths == 1):
                f.seek(int(starts[i]))
                out[i] = f.read(1) == b"\r"
        return out

    def __len__(self) -> int:
        return len(self._starts)

    def __getitem__(self, record_key: int) -> JsonlLine:
        i = int(record_key)
        if not 0 <= i < len(self):
            raise IndexError(f"record {i} out of range: {self.path!r} has {len(self)} lines")
        start, size = int(self._starts[i]), int(self._lengths[i])
        line_number = int(self._line_numbers[i])
        if self.max_line_bytes is not None and size > self.max_line_bytes:
            return JsonlLine(line_number, None, size)
        data = os.pread(self._descriptor(), size, start)
        return JsonlLine(line_number, data.removesuffix(b"\r"), size)

    def _descriptor(self) -> int:
        if self._fd is None:
            with self._lock:
                if self._fd is None:
                    self._fd = os.open(self.path, os.O_RDONLY)
        return self._fd

    def digest(self) -> str:
        """Identifies the content cheaply (size, line count, first and last MiB): a resumed job
        checks it is reading the file it started on."""
        h = hashlib.blake2b(digest_size=16)
        h.update(f"{self.size}:{len(self)}".encode())
        with open(self.path, "rb") as f:
            h.update(f.read(_DIGEST_SPAN))
            f.seek(max(0, self.size - _DIGEST_SPAN))
            h.update(f.read(_DIGEST_SPAN))
        return h.hexdigest()

    def __repr__(self) -> str:  # grain names a source by its repr in checkpoints
        return f"JsonlSource({self.path!r}, lines={len(self)})"

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_fd"], state["_lock"] = None, None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __del__(self) -> None:
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)


def import_grain():
    """grain, or an ImportError that says how to get it."""
    try:
        import grain
    except ImportError:
        raise ImportError(
            "reading batch input needs grain, which is not installed: pip install 'nori-jax[batch]'"
        ) from None
    return grain


def jsonl_dataset(
    source: Any, shard: grain.sharding.ShardOptions | None = None
) -> grain.MapDataset:
    """A source of JsonlLines (a JsonlSource, or `ArrayRecordLines`) as a grain MapDataset of
    `(position in this shard, JsonlLine)`; shard i of n holds lines i, i+n, ... (ValueError for
    `drop_remainder`: a batch job drops no request)."""
    grain = import_grain()
    ds = grain.MapDataset.source(source)
    if shard is not None:
        if shard.drop_remainder:
            raise ValueError("ShardOptions(drop_remainder=True) would drop requests")
        ds = ds[shard.shard_index :: shard.shard_count]
    return ds.map_with_index(lambda position, line: (position, line))
