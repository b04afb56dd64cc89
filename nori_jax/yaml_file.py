"""Reading the project's YAML files (engine, mesh and model presets, calibrations) with errors
that name the file: PyYAML's own say "<unicode string>" over several lines, and a file that is
not UTF-8 fails in the decoder with no name at all."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


def read_yaml(path: str | Path) -> Any:
    """The data of a YAML file; a ValueError naming the file, and the line where there is one,
    when it cannot be read, is not UTF-8 or not YAML (neither error of its own names the file)."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read {p}: {e.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ValueError(
            f"{p}: not UTF-8 (line {line}: byte {raw[e.start]:#04x}, {e.reason})"
        ) from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"{p}: not YAML ({_yaml_problem(e)})") from None


def _yaml_problem(e: yaml.YAMLError) -> str:
    """YAML's complaint on one line, at the line and column it gives (its own text says them of
    "<unicode string>", over several lines)."""
    mark = getattr(e, "problem_mark", None)
    if mark is None:
        return str(e).splitlines()[0]
    where = f"line {mark.line + 1}, column {mark.column + 1}"
    context = ""
    if e.context and e.context_mark:  # the construct it was in, and the line that began it
        context = f" ({e.context}, line {e.context_mark.line + 1})"
    return f"{where}: {e.problem}{context}"
