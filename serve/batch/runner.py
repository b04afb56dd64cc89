"""The batch job: a grain pipeline over the input, the engine in this process, the output with its
checkpoint.

    grain: JsonlSource -> this shard -> skip what is committed -> read_line (parse, validate,
           tokenize; in `reader_threads` threads, at most `read_ahead` lines ahead)
      -> stream_requests: at most `max_concurrency` requests queued or running in the engine
         (a line's `n` choices are n of them)
      -> answer_record (the server's body, once every choice of the line is in)
      -> BatchOutput (commit every `flush_lines` lines or `flush_seconds`, and at the end)

Throughput is the engine's: the step loop is LLMEngine's own (no HTTP, no engine-core process),
and parsing and tokenizing happen in grain's threads while the device runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from nori_jax.array_record_source import SUFFIXES as ARRAY_RECORD_SUFFIXES
from nori_jax.array_record_source import ArrayRecordLines
from nori_jax.jsonl_source import JsonlSource, import_grain, jsonl_dataset
from nori_jax.sampling_params import sample_choices
from nori_jax.stream_generate import StreamRequest, stream_requests
from serve.batch.format import encode
from serve.batch.output import BatchOutput, Totals
from serve.batch.progress import Progress
from serve.batch.requests import Refused, answer_record, batch_context, read_line
from serve.choices import choice_request_ids
from serve.settings import ServerSettings

if TYPE_CHECKING:
    from nori_jax.engine import LLMEngine

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class BatchOptions:
    model_name: str  # the name requests' `model` must match (the server's --served-model-name)
    chat_template: str | None = None  # Jinja source overriding the tokenizer's own
    shard_index: int = 0
    num_shards: int = 1
    max_concurrency: int | None = None  # requests queued or running; None: 2 * max_num_seqs
    read_ahead: int = 256  # lines grain reads (and prepares) ahead of the engine
    reader_threads: int = 2
    max_line_bytes: int = ServerSettings.max_body_bytes
    flush_lines: int = 256
    flush_seconds: float = 5.0
    overwrite: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        if not 0 <= self.shard_index < self.num_shards:
            raise ValueError(
                f"need 0 <= shard_index < num_shards, got {self.shard_index} and {self.num_shards}"
            )
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency={self.max_concurrency} must be >= 1")
        if self.read_ahead < 1 or self.reader_threads < 1:
            raise ValueError(
                f"need read_ahead >= 1 and reader_threads >= 1, got {self.read_ahead} and "
                f"{self.reader_threads}"
            )
        ServerSettings(self.model_name, max_body_bytes=self.max_line_bytes)  # its checks


@dataclasses.dataclass
class BatchSummary:
    output: str
    shard_requests: int  # lines of this shard
    run: Totals  # committed by this run
    job: Totals  # committed by every run of the job
    elapsed_s: float
    max_read_ahead: int  # the most lines grain had read past the one the engine took
    already_finished: bool = False

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {
            "request_throughput": self.run.requests / max(self.elapsed_s, 1e-9),
            "output_throughput": self.run.completion_tokens / max(self.elapsed_s, 1e-9),
            "total_token_throughput": (self.run.prompt_tokens + self.run.completion_tokens)
            / max(self.elapsed_s, 1e-9),
        }

    def format(self) -> str:
        d = self.as_dict()
        run, job = self.run, self.job
        rows = [
            ("Output:", self.output),
            (
                "Requests: this run / job / shard",
                f"{run.requests} / {job.requests} / {self.shard_requests}",
            ),
            ("Failed: this run / job", f"{run.failed} / {job.failed}"),
            ("Input / output tokens (this run):", f"{run.prompt_tokens} / {run.completion_tokens}"),
            ("Elapsed (s):", f"{self.elapsed_s:.2f}"),
            ("Request throughput (req/s):", f"{d['request_throughput']:.2f}"),
            ("Output token throughput (tok/s):", f"{d['output_throughput']:.1f}"),
            ("Total token throughput (tok/s):", f"{d['total_token_throughput']:.1f}"),
            ("Most lines read ahead:", self.max_read_ahead),
        ]
        title = " Batch Result (already complete) " if self.already_finished else " Batch Result "
        lines = [title.center(72, "=")]
        lines += [f"{k:<40}{str(v):>32}" for k, v in rows] + ["=" * 72]
        return "\n".join(lines)


class ReadAheadMeter:
    """How far grain's readers got past the line the engine was handed (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._max_seen = -1
        self.max_ahead = 0

    def saw(self, position: int) -> None:  # grain's reader threads
        with self._lock:
            self._max_seen = max(self._max_seen, position)

    def took(self, position: int) -> None:  # the engine loop
        with self._lock:
            self.max_ahead = max(self.max_ahead, self._max_seen - position)


@dataclasses.dataclass
class BatchJob:
    """An input shard and its output, opened (and resumed) but not run: cheap, no engine."""

    source: JsonlSource | ArrayRecordLines
    output: BatchOutput
    options: BatchOptions

    @classmethod
    def open(cls, input_path: str, output_path: str, options: BatchOptions) -> BatchJob:
        if os.path.realpath(input_path) == os.path.realpath(output_path) or _same_file(
            input_path, output_path
        ):  # (a hard link is the same file under another path)
            raise ValueError(f"the output {output_path!r} is the input itself")
        source = _open_source(input_path, options.max_line_bytes)
        identity = {
            "input_bytes": source.size,
            "input_lines": len(source),
            "input_digest": source.digest(),
            "shard_index": options.shard_index,
            "num_shards": options.num_shards,
        }
        try:
            output = BatchOutput(
                output_path, identity, options.flush_lines, options.flush_seconds, options.overwrite
            )
        except OSError as e:  # a missing directory, a path that is no writable file
            raise ValueError(
                f"cannot write the output {output_path!r}: {e.strerror or e}"
            ) from None
        return cls(source, output, options)

    @property
    def shard_requests(self) -> int:
        return len(range(self.options.shard_index, len(self.source), self.options.num_shards))

    def summary(self, run: Totals, elapsed_s: float, max_read_ahead: int) -> BatchSummary:
        return BatchSummary(
            self.output.path,
            self.shard_requests,
            run,
            dataclasses.replace(self.output.totals),
            elapsed_s,
            max_read_ahead,
            already_finished=self.output.finished_job and run.requests == 0,
        )

    def run(self, engine: LLMEngine) -> BatchSummary:
        grain = import_grain()
        opts, out = self.options, self.output
        if out.finished_job:
            out.close()
            return self.summary(Totals(), 0.0, 0)
        settings = ServerSettings(
            opts.model_name, chat_template=opts.chat_template, max_body_bytes=opts.max_line_bytes
        )
        ctx = batch_context(engine, settings)
        meter, skip = ReadAheadMeter(), frozenset(out.skip)

        def seen(item: tuple[int, Any]) -> tuple[int, Any]:
            meter.saw(item[0])
            return item

        ds = (
            jsonl_dataset(
                self.source, grain.sharding.ShardOptions(opts.shard_index, opts.num_shards)
            )
            .map(seen)
            .filter(lambda item: item[0] not in skip)
            .map(lambda item: (item[0], read_line(ctx, item[1])))
        )
        reading = grain.ReadOptions(
            num_threads=opts.reader_threads, prefetch_buffer_size=opts.read_ahead
        )
        # Skipping what a resumed job has committed is the point of the filter: no warning.
        quiet = grain.experimental.DatasetOptions(filter_warn_threshold_ratio=None)
        it = grain.experimental.WithOptionsIterDataset(
            ds.to_iter_dataset(reading), quiet
        ).__iter__()
        if out.grain_state is not None:
            it.set_state(out.grain_state)
        limit = opts.max_concurrency or 2 * engine.scheduler_config.max_num_seqs
        run = Totals()
        progress = Progress(self.shard_requests, out.totals.requests, opts.progress)

        def finish(position: int, record: dict[str, Any], done: Totals) -> None:
            out.finished(position, encode(record), done)
            run.add(done)
            progress.update(done)
            if out.due:
                out.commit(it.get_state())

        def requests() -> Iterator[StreamRequest]:
            while True:
                state = it.get_state()
                try:
                    position, item = next(it)
                except StopIteration:
                    return
                out.pulled(position, state)
                meter.took(position)
                if isinstance(item, Refused):
                    finish(position, item.record, Totals(requests=1, failed=1))
                    continue
                # A line's `n` choices are requests of their own, as the server queues them.
                request_id, n = item.route.new_request_id(), item.route.n
                key = (position, item, request_id, item.route.head(request_id))
                samples = zip(
                    choice_request_ids(request_id, n), sample_choices(item.params, n), strict=True
                )
                for j, (choice_id, params) in enumerate(samples):
                    yield StreamRequest((key, j), item.prompt_ids, params, choice_id, item.priority)

        start = time.perf_counter()
        finished_job = False
        waiting: dict[int, list[Any]] = {}  # a line's choices' results until all are in
        try:
            with contextlib.closing(stream_requests(engine, requests(), limit)) as results:
                for ((position, prepared, request_id, head), j), result in results:
                    choices = waiting.setdefault(position, [None] * prepared.route.n)
                    choices[j] = result
                    if any(c is None for c in choices):
                        continue
                    del waiting[position]
                    record = answer_record(prepared, request_id, head, choices)
                    finish(position, record, _counts(record, choices))
            finished_job = True
        finally:
            # Also on Ctrl-C or an error: what finished is kept, and a rerun goes on from there.
            out.commit(it.get_state(), finished_job)
            out.close()
            progress.close()
            it.close()
        return self.summary(run, time.perf_counter() - start, meter.max_ahead)


def _open_source(path: str, max_line_bytes: int) -> JsonlSource | ArrayRecordLines:
    """ArrayRecord by the file's suffix (.arrayrecord, .array_record), else JSONL."""
    if path.endswith(ARRAY_RECORD_SUFFIXES):
        return ArrayRecordLines(path, max_line_bytes)
    return JsonlSource(path, max_line_bytes)


def _counts(record: dict[str, Any], choices: list[Any]) -> Totals:
    """A line's totals: its prompt once, every choice's output (as the answer's usage)."""
    if record["response"]["status_code"] != 200:
        return Totals(requests=1, failed=1)
    completion = sum(len(c.token_ids) for c in choices)
    return Totals(1, 0, len(choices[0].prompt_token_ids), completion)


def run_batch(
    engine: LLMEngine, input_path: str, output_path: str, options: BatchOptions
) -> BatchSummary:
    """Run (or resume) the job of `options`' shard of `input_path` into `output_path`."""
    return BatchJob.open(input_path, output_path, options).run(engine)


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet): not the same file
        return False
