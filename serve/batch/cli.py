"""`nori-jax run-batch -i INPUT -o OUTPUT [engine flags]`: an OpenAI Batch API file through the
engine in this process. Rerun the same command after a crash to resume; see docs/batch.md."""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from nori_jax.engine_args import add_engine_args, engine_config_from_args
from serve.settings import ServerSettings

logger = logging.getLogger(__name__)


def add_run_batch_args(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Run an OpenAI Batch API file (JSONL: custom_id, method, url, body per line; urls "
        "/v1/completions and /v1/chat/completions) through the engine in this process, and "
        "write the answers as the Batch API's output lines, the server's bodies in them. A bad "
        "line gets an error line and the job goes on. Rerun the same command after a crash "
        "(even SIGKILL) to resume: OUTPUT.checkpoint.json says what is committed. Several "
        "processes split one file with --shard-index/--num-shards. See docs/batch.md."
    )
    g = p.add_argument_group("batch")
    g.add_argument("-i", "--input", required=True, help="the batch file (JSONL)")
    g.add_argument(
        "-o", "--output", required=True, help="the output file (JSONL); its checkpoint lies beside"
    )
    g.add_argument(
        "--served-model-name",
        default=None,
        help="the name a body's `model` must match (default: --model, as `nori-jax serve`)",
    )
    g.add_argument(
        "--chat-template",
        default=None,
        help="Jinja chat template: a file, or the template itself (overrides the model's)",
    )
    g.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="requests queued or running in the engine at once (default: 2 x --max-num-seqs)",
    )
    g.add_argument(
        "--shard-index", type=int, default=0, help="this process's shard (lines i, i+n, ...)"
    )
    g.add_argument("--num-shards", type=int, default=1, help="processes splitting the input")
    g.add_argument(
        "--read-ahead",
        type=int,
        default=256,
        help="lines read, parsed and tokenized ahead of the engine (the memory bound)",
    )
    g.add_argument("--reader-threads", type=int, default=2, help="grain threads reading lines")
    g.add_argument(
        "--max-line-bytes",
        type=int,
        default=ServerSettings.max_body_bytes,
        help="longer lines get an error line, unread (the server's body limit)",
    )
    g.add_argument(
        "--flush-lines", type=int, default=256, help="commit the output every this many lines"
    )
    g.add_argument(
        "--flush-interval",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="... or when this long has passed since the last commit",
    )
    g.add_argument(
        "--overwrite",
        action="store_true",
        help="start again even if OUTPUT exists (its checkpoint is replaced)",
    )
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_engine_args(p)
    p.set_defaults(func=run_batch_command)


def run_batch_command(args: argparse.Namespace) -> int:
    from nori_jax.jsonl_source import import_grain

    try:
        import_grain()
    except ImportError as e:
        raise ValueError(f"nori-jax run-batch: {e}") from None
    from serve.batch.output import Totals
    from serve.batch.runner import BatchJob, BatchOptions
    from serve.cli import DEFAULT_MODEL_NAME, chat_template_source

    config = engine_config_from_args(args)
    options = BatchOptions(
        model_name=args.served_model_name or config.model or DEFAULT_MODEL_NAME,
        chat_template=chat_template_source(args.chat_template),
        shard_index=args.shard_index,
        num_shards=args.num_shards,
        max_concurrency=args.max_concurrency,
        read_ahead=args.read_ahead,
        reader_threads=args.reader_threads,
        max_line_bytes=args.max_line_bytes,
        flush_lines=args.flush_lines,
        flush_seconds=args.flush_interval,
        overwrite=args.overwrite,
        progress=not args.no_progress,
    )
    # The job first: a bad input, a finished or foreign output fail before minutes of compiling.
    job = BatchJob.open(args.input, args.output, options)
    if job.output.finished_job:
        job.output.close()
        print(job.summary(Totals(), 0.0, 0).format())
        return 0
    # SIGTERM (a scheduler's stop) ends the job as Ctrl-C does: what finished is committed first
    # (and during the start-up's minutes of loading and compiling, nothing is lost).
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        from nori_jax.engine import LLMEngine

        engine = LLMEngine(config)
        summary = job.run(engine)
    except KeyboardInterrupt:
        print(
            f"interrupted: the finished requests are committed; rerun to resume {args.output}",
            file=sys.stderr,
        )
        return 130
    print(summary.format())
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
