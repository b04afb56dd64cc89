"""What the Pallas kernels ask of the device they run on: whether it is the CPU (interpret mode)
and how many SMs a grid can fill. Called through the module (`device_info.on_cpu()`), so a test
that lowers a kernel for CUDA on the CPU machine can patch one place."""

from __future__ import annotations

import jax

DEFAULT_NUM_SMS = 132  # an H100 / H200, where the device does not report its core count


def on_cpu() -> bool:
    return jax.default_backend() == "cpu"


def num_sms() -> int:
    return getattr(jax.devices()[0], "core_count", None) or DEFAULT_NUM_SMS
