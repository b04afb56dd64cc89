"""`nori-jax`: generate, chat, serve, bench. Each command registers its own sub-parser."""

from __future__ import annotations

import argparse
import logging
import sys

from nori_jax.engine_args import add_engine_args, engine_config_from_args


def _generate(args: argparse.Namespace) -> int:
    from nori_jax import LLM, SamplingParams

    llm = LLM.from_config(engine_config_from_args(args))
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sampling_seed,
        ignore_eos=args.ignore_eos,
    )
    prompts = args.prompt or [sys.stdin.read()]
    for out in llm.generate(prompts, params):
        print(out.text)
    return 0


def add_generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text for one or more prompts, offline")
    add_engine_args(p)
    p.add_argument("--prompt", action="append", help="a prompt (repeatable); default: stdin")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--sampling-seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.set_defaults(func=_generate)


def _optional_commands(sub) -> None:
    """Commands living in other packages; each brings its own flags."""
    import importlib

    for module, fn in (("nori_jax.chat_cli", "add_chat_parser"), ("serve.cli", "add_serve_parser")):
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name and module.startswith(e.name):
                continue  # command not built in this checkout
            raise
        getattr(mod, fn)(sub)
    from nori_jax.bench.cli import add_bench_serve_parser
    from nori_jax.bench.offline import add_bench_offline_parser

    bench = sub.add_parser(
        "bench", help="benchmarks: load generator against a server, offline runs"
    )
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    add_bench_serve_parser(bench_sub)
    add_bench_offline_parser(bench_sub)
    importlib.import_module("nori_jax.plan.cli").add_plan_parser(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nori-jax", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(sub)
    _optional_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # force: importing orbax makes absl configure the root logger first.
    logging.basicConfig(
        level=args.log_level.upper(),
        force=True,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
