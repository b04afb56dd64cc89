"""Argument-parser pieces of the `nori-jax` CLI: sub-commands built only when chosen, and help
lines that show their defaults.

A command's flags (and the modules that define them) load only when that command is on the
command line, so `nori-jax --help` imports no JAX and answers at once.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable, Iterator

Populate = Callable[[argparse.ArgumentParser], None]


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" to a help line, except where the line already states its default
    or there is nothing to state (a switch that is off, an unset value the line explains)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS, [], ""):
            return text
        return super()._get_help_string(action)


class LazySubParsers(argparse._SubParsersAction):
    """Sub-commands whose flags are added only when the command is parsed (or walked)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._pending: dict[str, str] = {}

    def add_lazy_parser(self, name: str, help: str, populate: str) -> argparse.ArgumentParser:
        """`populate` is "module:function"; the function adds the command's flags and `func`."""
        parser = self.add_parser(name, help=help, formatter_class=DefaultsHelpFormatter)
        self._pending[name] = populate
        return parser

    def populate(self, name: str) -> argparse.ArgumentParser:
        parser = self._name_parser_map[name]
        target = self._pending.pop(name, None)
        if target is not None:
            module, function = target.split(":")
            getattr(importlib.import_module(module), function)(parser)
        return parser

    def __call__(self, parser, namespace, values, option_string=None):
        if values and values[0] in self._pending:
            self.populate(values[0])
        super().__call__(parser, namespace, values, option_string)


def add_lazy_subparsers(parser: argparse.ArgumentParser, dest: str) -> LazySubParsers:
    return parser.add_subparsers(dest=dest, required=True, action=LazySubParsers, metavar="COMMAND")


def walk_parsers(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every (command path, parser) below `parser`, building lazy ones on the way (for tests and
    documentation)."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name in list(action._name_parser_map):
                sub = (
                    action.populate(name)
                    if isinstance(action, LazySubParsers)
                    else action._name_parser_map[name]
                )
                yield from walk_parsers(sub, (*path, name))
