"""The README's first-contact snippets, read from the README itself, so the test and the timing
script (benchmarks/engine/first_contact.py) run exactly what a new user copies."""

from __future__ import annotations

import re
import shlex
import shutil
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def readme_python_example() -> str:
    section = README.read_text().split("## Use it from Python", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def readme_command(name: str) -> list[str]:
    """The README's `nori-jax NAME ...` line as an argv, with this environment's executable."""
    for line in README.read_text().splitlines():
        if line.startswith(f"nori-jax {name} ") or line.strip() == f"nori-jax {name}":
            argv = shlex.split(line.split("#")[0])
            exe = shutil.which("nori-jax") or str(Path(sys.executable).with_name("nori-jax"))
            return [exe, *argv[1:]]
    raise AssertionError(f"the README has no `nori-jax {name}` line")
