"""What the engine hands back: one RequestOutput per request per step it progressed in."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from nori_jax.core.request import Request


class RequestMetrics(NamedTuple):
    """A request's stage timings in seconds (None where the stage was not reached).

    A NamedTuple, not a frozen dataclass: one is built per request per step, and a frozen
    dataclass's __init__ (object.__setattr__ per field) costs about 3.5x as much.
    """

    queue_time: float | None
    prefill_time: float | None
    decode_time: float | None
    time_to_first_token: float | None
    e2e_latency: float | None
    num_preemptions: int
    num_cached_tokens: int

    @classmethod
    def of(cls, req: Request) -> RequestMetrics:
        t = req.times
        ttft = None if t.first_token is None else t.first_token - t.arrival
        e2e = None if t.finished is None else t.finished - t.arrival
        return cls(
            t.queue_time,
            t.prefill_time,
            t.decode_time,
            ttft,
            e2e,
            req.num_preemptions,
            req.num_cached_tokens,
        )


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]  # every output token so far
    text: str  # the output text so far (stop strings cut off unless asked to keep them)
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    new_token_ids: list[int]  # tokens added by this step
    new_text: str  # text released by this step (held back while it may begin a stop string)
    logprobs: list[float] | None
    metrics: RequestMetrics
