"""A config field that carries its own documentation: one declaration serves the dataclass, the
YAML presets and the command-line flags (`engine_args.py` derives a flag from each field)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import numpy as np

# The simple field types `check_types` holds values to, and how an error names each.
_KINDS = {
    "int": ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    "float": ("a number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)),
    "bool": ("true or false", lambda v: isinstance(v, bool)),
    "str": ("a string", lambda v: isinstance(v, str)),
}


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


def check_types(config: Any, prefix: str = "") -> None:
    """Raise ValueError naming the first field of a (frozen) config dataclass whose value is not
    of its declared simple type: `int`, `float`, `bool`, `str`, each optionally `| None`. So
    `page_size="16"`, `max_num_seqs=8.5` or `async_scheduling="no"` fail here, by name, not deep
    inside the engine (or, for a truthy string, not at all). Numpy scalars become the Python
    numbers they hold first, and a path object (`pathlib.Path`) its path where a string goes.
    Fields of other types (nested configs) are their own checks'."""
    for field in dataclasses.fields(config):
        parts = [p.strip() for p in str(field.type).split("|")]
        kinds = [p for p in parts if p != "None"]
        if not kinds or any(k not in _KINDS for k in kinds):
            continue
        value = getattr(config, field.name)
        if isinstance(value, np.generic):
            value = value.item()
            object.__setattr__(config, field.name, value)
        elif "str" in kinds and isinstance(value, os.PathLike):  # a pathlib.Path: its path
            value = os.fspath(value)
            object.__setattr__(config, field.name, value)
        if value is None and "None" in parts:
            continue
        if not any(_KINDS[k][1](value) for k in kinds):
            want = " or ".join(_KINDS[k][0] for k in kinds) + (
                " or none" if "None" in parts else ""
            )
            raise ValueError(f"{prefix}{field.name}={value!r:.80} must be {want}")
