"""The planner's tests reuse the scheduler tests' fake runner (tests/core/fake_runner.py)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "core"))
