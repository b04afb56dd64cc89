"""What the engine hands back.

Two levels:
  - `EngineCoreOutputs`: what the engine core emits per step, raw and columnar (the requests that
    gained a token, their token ids, who finished and with which stage times, the step's
    scheduler stats). No text: detokenization happens where text is wanted. These are msgspec
    structs, so the engine-core process sends them as they are.
  - `RequestOutput`: what users read, built by the output processor. Outputs carry deltas
    (`new_token_ids`, `new_text`); the last one (`finished=True`) also carries the whole text,
    token ids and stage metrics. Nothing is copied per step in proportion to a request's length.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import msgspec
import numpy as np

from nori_jax.core.top_logprob_rows import TopLogprobRows


class RequestMetrics(NamedTuple):
    """A request's stage timings in seconds (None where the stage was not reached).

    A NamedTuple: cheap to build, and it travels through msgspec as an array.
    """

    queue_time: float | None
    prefill_time: float | None
    decode_time: float | None
    time_to_first_token: float | None
    e2e_latency: float | None
    num_preemptions: int
    num_cached_tokens: int


class FinishedRequest(msgspec.Struct, array_like=True, gc=False):
    request_id: str
    finish_reason: str  # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int
    num_output_tokens: int
    metrics: RequestMetrics
    error: str | None = None  # finish_reason "error": what this request made fail
    # The whole output, for a request sent with `EngineCoreRequest.final_token_ids` (by a
    # frontend in the core's process: its output processor then keeps no per-step list for a
    # final-only request); None otherwise (the API servers get every token per step anyway).
    token_ids: list[int] | None = None


class FirstToken(msgspec.Struct, array_like=True, gc=False):
    request_id: str
    time_to_first_token: float


class StepStats(msgspec.Struct, array_like=True, gc=False):
    """The scheduler's state after a step, and what the step added to the running counters."""

    num_running: int
    num_waiting: int
    kv_usage: float
    num_generated_tokens: int
    num_preemptions: int  # since the last StepStats
    prefix_cache_hits: int  # tokens, since the last StepStats
    prefix_cache_queries: int
    num_recompiles: int  # since the last StepStats
    schedule_seconds: float
    step_seconds: float
    num_steps: int  # engine steps covered (0 or 1)
    # The engine-core process's own work around the step (engine_core_process._serve): taking
    # requests off its socket and sending the step's outputs to the API servers. 0 elsewhere.
    io_seconds: float = 0.0
    # The launches this step fetched, (token bucket, kind, wall seconds) each (step_shapes.py): one
    # at most from one core, one per core from several (disaggregated).
    launches: list[tuple[int, str, float]] = msgspec.field(default_factory=list)


class KVTransfer(msgspec.Struct, array_like=True, gc=False):
    """One request's KV move from a prefill engine to a decode engine (disaggregated_core.py).

    `seconds`: from its first token on the host (the end of its prefill) to its pages landing in
    the decode engine's pool, waiting for room there included; 0 for a failed attempt.
    """

    request_id: str
    seconds: float
    num_bytes: int  # the request's pages (all layers); the page-count bucket's padding not counted
    num_pages: int  # pages moved (pages the decode side had in its prefix cache stay put)
    error: str | None = None  # a failed attempt: why (the request is retried or recomputed)


class EngineCoreOutputs(msgspec.Struct, array_like=True, gc=False):
    # Requests that gained a token, in row order; a request that gained several (a multi-step
    # launch) is listed once per token, in order.
    request_ids: list[str]
    token_bytes: bytes  # int32[len(request_ids)] (numpy bytes: one buffer, not a list)
    # float32[len(request_ids)]: each row's sampled token's logprob, every row's whether its
    # request asked or not (b"" where the executor gave none): a column like the tokens, so
    # neither the core nor the output processor does per-row work for them
    logprob_bytes: bytes
    finished: list[FinishedRequest]
    first_tokens: list[FirstToken]
    stats: StepStats | None = None
    transfers: list[KVTransfer] = []  # disaggregated engines: KV moves that landed or failed
    # For the requests with logprobs >= 1: per token gained, its most likely (token id,
    # logprob) pairs as two arrays (each request reads its own `logprobs` of them)
    top_logprobs: TopLogprobRows | None = None
    # For the requests with prompt_logprobs whose prompt's are complete with this step: each
    # prompt token's logprob after the first, (prompt_logprobs >= 1) its top pairs, and its rank
    prompt_logprobs: dict[
        str, tuple[list[float], list[tuple[tuple[int, float], ...]] | None, list[int]]
    ] = {}

    @property
    def token_ids(self) -> np.ndarray:
        return np.frombuffer(self.token_bytes, np.int32)

    @property
    def logprobs(self) -> np.ndarray:
        """float32, one per row, or empty where the executor gave none."""
        return np.frombuffer(self.logprob_bytes, np.float32)

    @classmethod
    def empty(cls) -> EngineCoreOutputs:
        return cls([], b"", b"", [], [])


@dataclasses.dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    new_token_ids: list[int]  # tokens added since the last output
    new_text: str  # text released since the last output (held back while it may begin a stop)
    new_logprobs: list[float] | None  # logprobs of new_token_ids, when asked for
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None while running
    # On the finished output only (None before): the whole output.
    token_ids: list[int] | None = None
    logprobs: list[float] | None = None
    metrics: RequestMetrics | None = None
    error: str | None = None  # finish_reason "error": why the engine failed this request alone
    # Which of its prompt's SamplingParams.n samples this is (0 to n - 1), as the offline API
    # (llm.py) sets it; the server numbers its choices itself.
    index: int = 0
    # logprobs >= 1: per token of new_token_ids (new_top_logprobs) and, on the finished output,
    # of the whole output (top_logprobs), its `logprobs` most likely (token id, logprob) pairs,
    # best first, of the distribution the sampled token's logprob is taken from. A token's pairs
    # are a tuple, not a list: the cyclic collector stops walking a tuple of numbers once it has
    # seen it, and walks a list for ever (at 1,024 rows asking for 20, the output processor took
    # 9.5-11.8 ms a step with lists, 4.0-5.1 with tuples: docs/benchmarks.md, "Host costs").
    new_top_logprobs: list[tuple[tuple[int, float], ...]] | None = None
    top_logprobs: list[tuple[tuple[int, float], ...]] | None = None
    # prompt_logprobs: per prompt token (None for the first) its logprob given the tokens before
    # it, and with prompt_logprobs = k >= 1 its position's k most likely (token id, logprob)
    # pairs; on every output once the prompt is computed (None before, and without them).
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[tuple[tuple[int, float], ...] | None] | None = None
    # each prompt token's rank at its position (1: the likeliest; None for the first)
    prompt_logprob_ranks: list[int | None] | None = None
    _text: str | None = dataclasses.field(default=None, repr=False)
    _decode: Callable[[], str] | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def text(self) -> str | None:
        """The whole output text (finished outputs only; stop strings cut off unless asked to
        keep them). Decoded on first read where no one streamed it."""
        if self._text is None and self._decode is not None:
            self._text, self._decode = self._decode(), None
        return self._text
