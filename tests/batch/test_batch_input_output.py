"""The batch job's input (a grain source over JSONL lines) and output (commits and resume), no
engine: line indexing, sharding, bounded read-ahead, and exactly-once resume after a crash at
any point between commits."""

from __future__ import annotations

import json
import pickle
import random
import subprocess
import sys
from pathlib import Path

import grain
import pytest

from nori_jax.jsonl_source import JsonlSource, jsonl_dataset
from serve.batch.output import CHECKPOINT_SUFFIX, BatchOutput, Totals


def test_lines_blank_crlf_and_no_final_newline(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"a":1}\n\n{"b":2}\r\n\r\n  \n{"c":3}')
    source = JsonlSource(path, max_line_bytes=7)
    lines = [source[i] for i in range(len(source))]
    # Blank lines are no records; a spaces-only line is one (it reads as a line that is not JSON).
    assert [(x.index, x.data) for x in lines] == [
        (0, b'{"a":1}'),
        (2, None),  # 8 bytes with its \r: over max_line_bytes, not read
        (4, b"  "),
        (5, b'{"c":3}'),
    ]
    assert lines[1].size == 8
    assert pickle.loads(pickle.dumps(source))[3].data == b'{"c":3}'  # grain's worker processes
    with pytest.raises(IndexError, match="out of range"):
        source[4]
    with pytest.raises(ValueError, match="is not a file"):
        JsonlSource(tmp_path / "missing.jsonl")


def test_shards_cover_the_file_exactly_once(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text("".join(f'{{"i": {i}}}\n' for i in range(103)))
    source = JsonlSource(path)
    seen = []
    for k in range(3):
        shard = list(jsonl_dataset(source, grain.sharding.ShardOptions(k, 3)))
        assert [p for p, _ in shard] == list(range(len(shard)))  # positions within the shard
        seen += [json.loads(line.data)["i"] for _, line in shard]
    assert sorted(seen) == list(range(103))
    with pytest.raises(ValueError, match="drop requests"):
        jsonl_dataset(source, grain.sharding.ShardOptions(0, 2, drop_remainder=True))


def test_read_ahead_is_bounded_on_20000_lines(tmp_path: Path) -> None:
    """A slow consumer of a 20,000-line file: grain never reads more than its prefetch buffer
    past the line consumed (the memory bound of `run-batch --read-ahead`)."""
    path = tmp_path / "in.jsonl"
    path.write_text("".join(f'{{"i": {i}}}\n' for i in range(20_000)))
    reads: list[int] = []
    source = JsonlSource(path)
    real_getitem = source.__getitem__

    class Counting(JsonlSource):
        def __getitem__(self, i):
            reads.append(i)
            return real_getitem(i)

    source.__class__ = Counting
    it = iter(
        jsonl_dataset(source).to_iter_dataset(
            grain.ReadOptions(num_threads=2, prefetch_buffer_size=32)
        )
    )
    most_ahead = 0
    for consumed, (position, _) in enumerate(it):
        assert position == consumed
        most_ahead = max(most_ahead, len(reads) - (consumed + 1))
    assert len(reads) == 20_000
    assert 0 < most_ahead <= 32


def _identity() -> dict:
    return {
        "input_bytes": 1,
        "input_lines": 10,
        "input_digest": "x",
        "shard_index": 0,
        "num_shards": 1,
    }


def _line(position: int) -> bytes:
    return json.dumps({"custom_id": f"r{position}"}).encode() + b"\n"


def _ids(path: Path) -> list[str]:
    return [json.loads(x)["custom_id"] for x in path.read_bytes().splitlines()]


@pytest.mark.parametrize("seed", range(4))
def test_resume_after_a_crash_answers_each_position_once(tmp_path: Path, seed: int) -> None:
    """Positions finish out of order; the process dies after a random number of them, its last
    lines written but not committed, the last one torn; every resume cuts the output back to the
    commit and filters what is committed. Over all runs each of the 40
    positions is in the output exactly once."""
    rng = random.Random(seed)
    path = str(tmp_path / "out.jsonl")
    total, runs = 40, 0
    while True:
        runs += 1
        out = BatchOutput(path, _identity(), flush_lines=3)
        committed = json.loads(Path(path + CHECKPOINT_SUFFIX).read_text())["output_bytes"]
        assert Path(path).stat().st_size == committed  # what the crash left past it is cut off
        if out.finished_job:
            break
        start = 0 if out.grain_state is None else out.grain_state["next_index"]
        todo = [p for p in range(start, total) if p not in out.skip]
        window: list[int] = []  # pulled, not finished: up to 5 in flight
        crash_after = rng.randrange(1, 15)
        next_index = start  # grain's state: the position after the last one pulled
        for n, position in enumerate(todo):
            out.pulled(position, {"next_index": next_index})
            next_index = position + 1
            window.append(position)
            if len(window) == 5 or n == len(todo) - 1:
                rng.shuffle(window)
                for p in window:
                    out.finished(p, _line(p), Totals(requests=1))
                    if out.due:
                        out.commit({"next_index": next_index})
                window = []
            if n == crash_after:
                break
        else:
            out.commit({"next_index": total}, finished_job=True)
            out.close()
            continue
        # The crash hit after the lines went out but before the checkpoint moved, mid-line.
        out._out.write(b"".join(out._lines) + b'{"custom_id": "torn')
        out._out.flush()
        out.close()
    ids = _ids(Path(path))
    assert sorted(ids) == sorted(f"r{p}" for p in range(total)), ids
    assert runs > 2  # it did crash and resume


def test_output_refuses_foreign_files(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    path.write_text("someone's results\n")
    with pytest.raises(ValueError, match="no checkpoint beside it"):
        BatchOutput(str(path), _identity())
    BatchOutput(str(path), _identity(), overwrite=True).close()
    assert path.read_bytes() == b"" and (tmp_path / f"out.jsonl{CHECKPOINT_SUFFIX}").exists()
    with pytest.raises(ValueError, match="checkpoint of another job"):
        BatchOutput(str(path), _identity() | {"num_shards": 2})


def _cli(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_run_batch_help_imports_neither_jax_nor_grain() -> None:
    r = _cli(
        "import sys\n"
        "from nori_jax.cli import main\n"
        "try:\n    main(['run-batch', '--help'])\nexcept SystemExit:\n    pass\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'grain', 'fastapi'))\n"
        "assert not heavy, heavy\n"
    )
    assert r.returncode == 0, r.stderr
    assert "--max-concurrency" in r.stdout and "--shard-index" in r.stdout


def test_without_grain_run_batch_says_how_to_install_it(tmp_path: Path) -> None:
    r = _cli(
        "import sys\n"
        "sys.modules['grain'] = None  # as if not installed\n"
        "from nori_jax.cli import main\n"
        f"sys.exit(main(['run-batch', '-i', {str(tmp_path / 'in')!r}, '-o', 'out']))\n"
    )
    assert r.returncode == 2 and "pip install 'nori-jax[batch]'" in r.stderr, r.stderr
