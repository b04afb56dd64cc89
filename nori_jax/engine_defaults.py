"""The engine config an entry point uses when its caller names none: sized for the backend.

Every entry point (`LLM()`, `nori-jax generate / chat / serve`, `bench offline`) resolves its
config here, so they agree: an explicit preset is used as given; without one, a CPU backend gets
the small `cpu` preset (a first start within a minute or two) and an accelerator gets
`EngineConfig`'s defaults, the throughput shapes. Values the caller gives always win.
"""

from __future__ import annotations

import logging
from typing import Any

from nori_jax.engine_config import EngineConfig

logger = logging.getLogger(__name__)
CPU_PRESET = "cpu"


def backend_preset(backend: str) -> str | None:
    """The preset used on `backend` when none is named (None: EngineConfig's defaults)."""
    return CPU_PRESET if backend == "cpu" else None


def resolve_engine_config(preset: str | None, given: dict[str, Any]) -> EngineConfig:
    """`preset` (a name or path; None: the backend's default) with every value of `given` on
    top, None included. Logs which config was chosen and what was overridden."""
    overridden = f"; given: {', '.join(sorted(given))}" if given else ""
    if preset is not None:
        logger.info("engine config: preset %r%s", str(preset), overridden)
        return EngineConfig.from_preset(preset, given)
    _join_distributed(given)
    import jax  # only here: choosing needs the backend, building the CLI does not

    backend = jax.default_backend()
    chosen = backend_preset(backend)
    if chosen is None:
        logger.info(
            "engine config: EngineConfig's defaults, the throughput shapes for a %s backend%s",
            backend,
            overridden,
        )
        return EngineConfig.from_dict(given)
    logger.info(
        "engine config: preset %r, the default on a %s backend (small shapes for a quick start; "
        "pass a config for others)%s",
        chosen,
        backend,
        overridden,
    )
    return EngineConfig.from_preset(chosen, given)


def _join_distributed(given: dict[str, Any]) -> None:
    """A multi-host engine joins JAX's distributed runtime before JAX starts its backends, which
    asking for the backend here would do."""
    from nori_jax.distributed_config import DistributedConfig
    from nori_jax.engine_config import nested_values

    section = nested_values(given, source="overrides").get("distributed")
    if section:
        config = DistributedConfig(**section)
        if config.enabled:
            from nori_jax.executor import distributed

            distributed.join(config)
