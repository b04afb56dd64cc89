"""Logging of the `nori-jax` commands: the engine's progress at INFO, other libraries' chatter
only when asked for (--log-level DEBUG).

Only the CLI calls this: it owns its process. The library never configures logging, so a program
importing nori_jax keeps its own settings.
"""

from __future__ import annotations

import logging

# Loggers that speak at INFO about things a user cannot act on: JAX's probe for a TPU on every
# machine without one ("Unable to initialize backend 'tpu'"), and orbax's checkpoint
# progress through absl.
QUIET_UNLESS_DEBUG = ("jax._src.xla_bridge", "absl")


def configure(level: str) -> None:
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"--log-level {level!r} is not a logging level (DEBUG, INFO, WARNING...)")
    # force: a library imported earlier (absl, through orbax) may have configured the root
    # logger already, which would make this call a no-op.
    logging.basicConfig(
        level=numeric, force=True, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for name in QUIET_UNLESS_DEBUG:
        logging.getLogger(name).setLevel(
            logging.DEBUG if numeric <= logging.DEBUG else logging.WARNING
        )
