"""Content digests of checkpoint files, remembered per (path, size, mtime) so a file is read for
hashing once, not at every start.

The parameter cache keys on these digests rather than on paths: two installs of one model (two
virtualenvs, a copied file) share one cache entry.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

MEMO_FILE = "digests.json"


def file_digest(path: Path, memo_dir: Path) -> str:
    """sha256 of the file's bytes (hex, 32 digits); memoized in `memo_dir`/digests.json."""
    st = path.stat()
    stamp = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    memo_path = memo_dir / MEMO_FILE
    memo = _read(memo_path)
    if stamp in memo:
        return memo[stamp]
    with path.open("rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()[:32]
    memo[stamp] = digest
    _write(memo_path, memo)
    return digest


def _read(path: Path) -> dict[str, str]:
    try:
        memo = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return memo if isinstance(memo, dict) else {}


def _write(path: Path, memo: dict[str, str]) -> None:
    # Atomic replace: concurrent starts may each lose the other's entry, never corrupt the file.
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(memo, indent=0))
        tmp.replace(path)
    except OSError:
        pass  # a read-only cache directory only costs hashing again next time
