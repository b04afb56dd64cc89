"""The async engine interface the server (and async library users) program against.

Two implementations: `EngineCoreClient` (core_client.py; the engine core in its own process, what
`nori-jax serve` runs) and `AsyncEngine` (async_engine.py; the engine stepped by a thread of this
process). Both stream `RequestOutput` deltas through a `RequestStream` per request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from nori_jax.async_engine import RequestStream
from nori_jax.core.outputs import RequestOutput
from nori_jax.metrics import EngineMetrics
from nori_jax.sampling_params import SamplingParams
from nori_jax.tokenizer import Tokenizer


class EngineClient(Protocol):
    tokenizer: Tokenizer | None
    max_model_len: int
    metrics: EngineMetrics

    @property
    def is_started(self) -> bool: ...

    @property
    def is_healthy(self) -> bool: ...

    @property
    def dead_reason(self) -> str | None: ...

    @property
    def num_in_flight(self) -> int: ...

    def start(self) -> None: ...

    async def shutdown(self, drain_timeout_s: float | None = None) -> None: ...

    def stop(self, timeout_s: float = 30.0) -> None: ...

    def tokenize(self, prompt: str | list[int]) -> list[int]: ...

    async def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        timeout_s: float | None = None,
        stream: bool = True,
        priority: int = 0,
    ) -> RequestStream: ...

    def abort(self, request_id: str) -> None: ...

    async def control(self, op: str, level: int = 1, model_path: str | None = None) -> bool:
        """A weight operation between steps (weight_control.run_control's `op`); whether the
        engine sleeps after it."""
        ...

    def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        timeout_s: float | None = None,
    ) -> AsyncIterator[RequestOutput]: ...

    def get_metrics(self) -> dict[str, Any]: ...
