"""What every async engine client builds on top of its own `add_request` and `metrics`: the
streaming `generate` and `get_metrics` of the EngineClient protocol (engine_client.py), written
once for AsyncEngine (async_engine.py) and EngineCoreClient (core_client.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from nori_jax.core.outputs import RequestOutput
from nori_jax.sampling_params import SamplingParams


def check_timeout(timeout_s: float | None) -> None:
    """ValueError unless a request's `timeout_s` is None (no bound) or > 0."""
    if timeout_s is not None and timeout_s <= 0:
        raise ValueError(f"timeout_s={timeout_s} must be > 0")


class StreamingClient:
    """Mixin: needs `add_request(prompt, params, request_id, timeout_s)` and `metrics`."""

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        timeout_s: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; the request is aborted if the consumer stops early."""
        stream = await self.add_request(prompt, params, request_id, timeout_s)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    def get_metrics(self) -> dict[str, Any]:
        """The engine's metrics; gauges are as of the last step the client has seen."""
        return self.metrics.as_dict()
