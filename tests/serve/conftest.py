"""Fixtures shared by the serve tests; the server itself is in serve_harness.py."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from serve_harness import Server


@pytest.fixture
def slow_steps(request) -> Iterator[None]:
    """Each engine step of the module's server sleeps 20 ms more: requests stay in flight long
    enough to disconnect, time out or kill the engine under them, whatever the machine's speed."""
    server: Server = request.getfixturevalue("server")
    runner = server.llm_engine.runner
    real_launch = runner.launch

    def launch(plan):
        time.sleep(0.02)
        return real_launch(plan)

    runner.launch = launch
    yield
    del runner.launch  # the instance attribute goes, the class's method shows again
