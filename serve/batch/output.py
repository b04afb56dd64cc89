"""The output file and its checkpoint: durable, batched writes, and a job that resumes after a
crash (SIGKILL included) with every request answered exactly once.

Beside `OUTPUT` lies `OUTPUT.checkpoint.json`, the commit record. A commit appends the lines
finished since the last one to the output, fsyncs it, then replaces the checkpoint atomically
(write, fsync, rename, fsync of the directory). The checkpoint says:

- `output_bytes`: how much of the output is committed. Whatever lies beyond (a torn line, lines
  written before a crash hit the rename) is cut off on resume and those requests run again;
- `grain_state`: the input iterator's state (grain's checkpointable `get_state()`) at the low-water
  mark: every request before it is in the committed output;
- `committed_ahead`: the positions past the low-water mark that are committed too (requests
  finish out of order); on resume they are filtered out of the input.

Positions are a request's index in this process's shard. A rerun compares the input's identity
(size, line count, a digest of its ends) and the shard with the checkpoint's, so a changed input
or shard is refused rather than silently mixed.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import time
from typing import Any

CHECKPOINT_SUFFIX = ".checkpoint.json"


@dataclasses.dataclass
class Totals:
    """What the job has committed so far, over all its runs."""

    requests: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def add(self, other: Totals) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


@dataclasses.dataclass
class _Entry:  # a request pulled from the input, in pull order
    position: int
    state_before: dict[str, Any]  # the input iterator's state just before it was pulled
    done: bool = False  # finished: its line is written by the next commit at the latest


class BatchOutput:
    """The output of one job (one shard of one input). Use `open`, then per request `pulled`
    (in input order) and `finished` (in any order); `commit` when `due`, and at the end."""

    def __init__(
        self,
        path: str,
        identity: dict[str, Any],
        flush_lines: int = 256,
        flush_seconds: float = 5.0,
        overwrite: bool = False,
    ):
        if flush_lines < 1 or flush_seconds < 0:
            raise ValueError(
                f"need flush_lines >= 1 and flush_seconds >= 0, got {flush_lines}, {flush_seconds}"
            )
        self.path, self.checkpoint_path = path, path + CHECKPOINT_SUFFIX
        self.identity = identity
        self.flush_lines, self.flush_seconds = flush_lines, flush_seconds
        self.grain_state: dict[str, Any] | None = None  # where the input resumes (None: start)
        self.skip: set[int] = set()  # positions past grain_state already committed
        self.totals = Totals()  # committed, all runs
        self.finished_job = False
        self._floor = -1  # positions below it are behind the low-water mark for good
        self._pending: collections.deque[_Entry] = collections.deque()
        self._by_position: dict[int, _Entry] = {}
        self._lines: list[bytes] = []  # finished, not yet committed
        self._uncommitted = Totals()
        self._last_commit = time.monotonic()
        self._open(overwrite)

    # ---- opening, resuming ------------------------------------------------------------------

    def _open(self, overwrite: bool) -> None:
        exists = os.path.exists(self.path)
        if overwrite or not os.path.exists(self.checkpoint_path):
            if exists and os.path.getsize(self.path) and not overwrite:
                raise ValueError(
                    f"output {self.path!r} exists and has no checkpoint beside it "
                    f"({os.path.basename(self.checkpoint_path)}): not a job to resume; pass "
                    "--overwrite to start again, or choose another output"
                )
            self._out = open(self.path, "wb")
            self._write_checkpoint()  # from here on a crash is resumable
            return
        with open(self.checkpoint_path) as f:
            ckpt = json.load(f)
        if ckpt.get("identity") != self.identity:
            raise ValueError(
                f"{self.checkpoint_path!r} is the checkpoint of another job: it was made for "
                f"{ckpt.get('identity')}, this job is {self.identity}; pass --overwrite to "
                "start again, or choose another output"
            )
        committed = ckpt["output_bytes"]
        if not exists or os.path.getsize(self.path) < committed:
            raise ValueError(
                f"output {self.path!r} holds less than its checkpoint committed "
                f"({committed} bytes): it was changed; pass --overwrite to start again"
            )
        self.grain_state = ckpt["grain_state"]
        self.skip = set(ckpt["committed_ahead"])
        self.totals = Totals(**ckpt["totals"])
        self.finished_job = ckpt["finished"]
        self._out = open(self.path, "r+b")
        self._out.truncate(committed)  # lines past the commit run again
        self._out.seek(committed)
        self._fsync(self._out)

    # ---- per request ------------------------------------------------------------------------

    def pulled(self, position: int, state_before: dict[str, Any]) -> None:
        entry = _Entry(position, state_before)
        self._pending.append(entry)
        self._by_position[position] = entry

    def finished(self, position: int, line: bytes, done: Totals) -> None:
        entry = self._by_position.pop(position)
        assert not entry.done, position
        entry.done = True
        self._lines.append(line)
        self._uncommitted.add(done)

    @property
    def due(self) -> bool:
        return len(self._lines) >= self.flush_lines or (
            self._lines and time.monotonic() - self._last_commit >= self.flush_seconds
        )

    @property
    def num_uncommitted(self) -> int:
        return len(self._lines)

    def commit(self, state_now: dict[str, Any], finished_job: bool = False) -> None:
        """Make every finished line durable, then move the checkpoint to match. `state_now` is
        the input iterator's state now (where a job with nothing pending resumes)."""
        if self._lines:
            self._out.write(b"".join(self._lines))
            self._fsync(self._out)
            self._lines = []
        self.totals.add(self._uncommitted)
        self._uncommitted = Totals()
        # Entries finished before this commit are now durable: their prefix leaves the window.
        while self._pending and self._pending[0].done:
            self._floor = self._pending.popleft().position + 1
        self.grain_state = self._pending[0].state_before if self._pending else state_now
        self.skip = {p for p in self.skip if p >= self._floor}
        self.finished_job = finished_job
        self._write_checkpoint()
        self._last_commit = time.monotonic()

    def close(self) -> None:
        self._out.close()

    # ---- files ------------------------------------------------------------------------------

    def _write_checkpoint(self) -> None:
        ahead = sorted(self.skip | {e.position for e in self._pending if e.done})
        ckpt = {
            "identity": self.identity,
            "output_bytes": self._out.tell(),
            "grain_state": self.grain_state,
            "committed_ahead": ahead,
            "totals": dataclasses.asdict(self.totals),
            "finished": self.finished_job,
        }
        tmp = self.checkpoint_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(ckpt, f)
            self._fsync(f)
        os.replace(tmp, self.checkpoint_path)
        directory = os.open(os.path.dirname(os.path.abspath(self.path)), os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)

    @staticmethod
    def _fsync(f) -> None:
        f.flush()
        os.fsync(f.fileno())
