"""The environment of a fresh process whose JAX sees several CPU devices (mesh tests)."""

from __future__ import annotations

import os


def cpu_devices_flags(count: int) -> str:
    """XLA_FLAGS for `count` CPU devices, keeping the flags the tests already set (conftest.py's
    optimization level, which the child's compiles need as much as this process's)."""
    flags = os.environ.get("XLA_FLAGS", "")
    return f"{flags} --xla_force_host_platform_device_count={count}".strip()


def cpu_devices_env(count: int) -> dict[str, str]:
    return dict(os.environ, XLA_FLAGS=cpu_devices_flags(count), JAX_PLATFORMS="cpu")
