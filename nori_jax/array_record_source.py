"""An ArrayRecord file of JSON requests as the batch input: grain's own `ArrayRecordDataSource`,
each record one request line, handed out as a `JsonlLine` like a JSONL file's.

ArrayRecord (Google's random-access record format, which grain reads natively) indexes its
records itself, so there is no line index to build. A record over `max_line_bytes` is read
before it can be refused (its length is not known without reading it).
"""

from __future__ import annotations

import hashlib
import os

from nori_jax.jsonl_source import JsonlLine, import_grain

SUFFIXES = (".arrayrecord", ".array_record")


class ArrayRecordLines:
    """grain `RandomAccessDataSource` over an ArrayRecord file's records (a `JsonlLine` each)."""

    def __init__(self, path: str | os.PathLike, max_line_bytes: int | None = None):
        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise ValueError(f"input {self.path!r} is not a file")
        if max_line_bytes is not None and max_line_bytes < 1:
            raise ValueError(f"max_line_bytes={max_line_bytes} must be >= 1")
        self.max_line_bytes = max_line_bytes
        self.size = os.path.getsize(self.path)
        self._records = import_grain().sources.ArrayRecordDataSource(self.path)

    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, record_key: int) -> JsonlLine:
        i = int(record_key)
        if not 0 <= i < len(self):
            raise IndexError(f"record {i} out of range: {self.path!r} has {len(self)} records")
        data = self._records[i]
        if self.max_line_bytes is not None and len(data) > self.max_line_bytes:
            return JsonlLine(i, None, len(data))
        return JsonlLine(i, data, len(data))

    def digest(self) -> str:
        """Identifies the content cheaply (size, record count, the first and last records)."""
        h = hashlib.blake2b(digest_size=16)
        h.update(f"{self.size}:{len(self)}".encode())
        if len(self):
            h.update(self._records[0])
            h.update(self._records[len(self) - 1])
        return h.hexdigest()

    def __repr__(self) -> str:
        return f"ArrayRecordLines({self.path!r}, records={len(self)})"
