"""A config field that carries its own documentation: one declaration serves the dataclass, the
YAML presets and the command-line flags (`engine_args.py` derives a flag from each field)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any


def option(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    default_factory: Callable[[], Any] | Any = dataclasses.MISSING,
    flags: tuple[str, ...] = (),
    choices: tuple[str, ...] | None = None,
) -> Any:
    """A dataclass field with its help line. `flags` names the command-line flags when they differ
    from `--field-name` (vLLM's names where vLLM has the setting); `choices` restricts a string."""
    metadata = {"help": help, "flags": flags, "choices": choices}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def help_of(field: dataclasses.Field) -> str:
    return field.metadata.get("help", "")
