"""`nori-jax`: generate, chat, serve, run-batch, bench, plan, cache.

Each command's flags and modules load only when that command runs (cli_parsing.LazySubParsers),
so `nori-jax --help` imports no JAX.
"""

from __future__ import annotations

import argparse
import sys

from nori_jax.cli_parsing import DefaultsHelpFormatter, add_lazy_subparsers

COMMANDS = {
    "generate": (
        "generate text for one or more prompts, offline",
        "nori_jax.generate_cli:add_generate_args",
    ),
    "chat": ("interactive chat in the terminal, streaming", "nori_jax.chat_cli:add_chat_args"),
    "serve": ("OpenAI-compatible HTTP server (FastAPI + uvicorn)", "serve.cli:add_serve_args"),
    "run-batch": (
        "an OpenAI Batch API file through the engine, offline; resumable, shardable",
        "serve.batch.cli:add_run_batch_args",
    ),
    "bench": (
        "benchmarks: load generator against a server, offline runs",
        "nori_jax.cli:add_bench_args",
    ),
    "plan": (
        "capacity planning: the scheduler in simulated time over a calibrated step model",
        "nori_jax.plan.cli:add_plan_args",
    ),
    "cache": (
        "the on-disk caches: where they are, how big, clear them",
        "nori_jax.cache_cli:add_cache_args",
    ),
}


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    import functools

    from nori_jax.bench.cli import add_bench_serve_parser
    from nori_jax.bench.offline import add_bench_offline_parser

    bench_sub = parser.add_subparsers(
        dest="bench_command",
        required=True,
        parser_class=functools.partial(
            argparse.ArgumentParser, formatter_class=DefaultsHelpFormatter
        ),
    )
    add_bench_serve_parser(bench_sub)
    add_bench_offline_parser(bench_sub)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nori-jax", description=__doc__.split("\n")[0], formatter_class=DefaultsHelpFormatter
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        help="INFO shows start-up progress; DEBUG adds JAX's and orbax's own messages",
    )
    sub = add_lazy_subparsers(parser, "command")
    for name, (help_text, populate) in COMMANDS.items():
        sub.add_lazy_parser(name, help_text, populate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from nori_jax import cli_logging

    try:
        cli_logging.configure(args.log_level)
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C where a command has no handling of its own: no traceback
        print("interrupted", file=sys.stderr)
        return 130  # the shell's code for SIGINT


if __name__ == "__main__":
    sys.exit(main())
