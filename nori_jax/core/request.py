"""A request's state as the scheduler sees it: tokens, pages, progress and stage timestamps."""

from __future__ import annotations

import dataclasses
import enum
import time

import numpy as np

from nori_jax.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    # Disaggregation: holds pages but no slot. On a prefill engine: prefilled, its first token
    # sampled, waiting for its KV to move; on a decode engine: moved in, waiting for a slot.
    TRANSFER = "transfer"
    FINISHED = "finished"


@dataclasses.dataclass
class RequestTimes:
    """Monotonic timestamps (time.monotonic) of a request's stages; None until reached."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    preemptions: list[float] = dataclasses.field(default_factory=list)

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled is None else self.first_scheduled - self.arrival

    @property
    def prefill_time(self) -> float | None:
        if self.first_token is None or self.first_scheduled is None:
            return None
        return self.first_token - self.first_scheduled

    @property
    def decode_time(self) -> float | None:
        if self.first_token is None or self.last_token is None:
            return None
        return self.last_token - self.first_token


# eq=False: a request is compared by identity. The scheduler removes requests from its lists
# (`running.remove(req)` on every finish); a generated field-by-field __eq__ made each of those
# compare a thousand running requests tuple by tuple, the largest host cost of a mixed step.
@dataclasses.dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # the sampling seed actually used (params.seed or one drawn at arrival)
    eos_token_ids: tuple[int, ...] = ()
    times: RequestTimes = dataclasses.field(default_factory=lambda: RequestTimes(time.monotonic()))
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    pages: list[int] = dataclasses.field(default_factory=list)
    # Tokens whose K/V are in `pages` or being written by a step already launched: the scheduler
    # advances it when it schedules a chunk, before the device has run it.
    num_computed_tokens: int = 0
    # Sampled by a launched step but not yet fetched (0 or 1): with overlapped scheduling the
    # next step is planned before the previous one's token reaches the host.
    num_pending_tokens: int = 0
    last_row: int = -1  # the request's row in the last plan it sampled in
    num_cached_tokens: int = 0  # of those, how many came from the prefix cache at admission
    num_registered_pages: int = 0  # leading full pages already published to the prefix cache
    page_hashes: list[bytes] = dataclasses.field(default_factory=list)  # hash chain of full pages
    num_preemptions: int = 0
    is_long: bool = False
    slot: int | None = None  # row in the scheduler's BatchSlots while running
    final_token_ids: bool = False  # its FinishedRequest carries output_token_ids (engine_core.py)
    # Under the priority policy, lower runs first and is preempted last; ties go by arrival
    # (`arrival_index`: the scheduler's count of requests added before it).
    priority: int = 0
    arrival_index: int = 0
    # prompt_logprobs: positions planned so far (each is computed once, even if recomputed after
    # a preemption) and, per prompt token after the first, its logprob (and top pairs)
    prompt_logprobs_planned: int = 0
    prompt_logprobs: list[float] = dataclasses.field(default_factory=list)
    prompt_top_logprobs: list[tuple[tuple[int, float], ...]] = dataclasses.field(
        default_factory=list
    )
    prompt_logprob_ranks: list[int] = dataclasses.field(default_factory=list)
    # The prompt as int32, made on first use (the prompt never changes): prefill chunks and page
    # hashes read slices of it instead of converting a list of ints each time.
    _prompt_array: np.ndarray | None = dataclasses.field(default=None, init=False, repr=False)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Known tokens: prompt + fetched output."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_scheduled_total(self) -> int:
        """Tokens the request will have once pending samples arrive."""
        return self.num_tokens + self.num_pending_tokens

    @property
    def num_remaining(self) -> int:
        """Tokens still to feed through the model before the next sample."""
        return self.num_scheduled_total - self.num_computed_tokens

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without building the whole list."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    def token_array(self, start: int, end: int) -> np.ndarray:
        """Tokens [start, end) as int32[end - start]; within the prompt, a read-only view."""
        if self._prompt_array is None:
            self._prompt_array = np.asarray(self.prompt_token_ids, np.int32)
            self._prompt_array.flags.writeable = False
        p = len(self.prompt_token_ids)
        if end <= p:
            return self._prompt_array[start:end]
        out = np.asarray(self.output_token_ids[max(start - p, 0) : end - p], np.int32)
        return out if start >= p else np.concatenate([self._prompt_array[start:], out])

    @property
    def min_tokens_stop_ids(self) -> tuple[int, ...]:
        """The ids it may not sample before `min_tokens` outputs: its stop token ids and, unless
        it ignores EOS, its EOS ids (none without min_tokens)."""
        p = self.params
        if not p.min_tokens:
            return ()
        eos = () if p.ignore_eos else self.eos_token_ids
        return tuple(sorted(set(p.stop_token_ids) | set(eos)))

    def reads_prefix_cache(self) -> bool:
        """May its admission take KV from the prefix cache? Not where it needs the tokens the
        cache would skip: prompt logprobs not all planned yet; penalties with output tokens
        (resumed after a preemption: they are recounted as they are recomputed). (A new request
        with repetition_penalty reads it: its cached prompt's ids come as marks, scheduler.py.)"""
        p = self.params
        unplanned = self.prompt_logprobs_planned < self.num_prompt_tokens - 1
        if p.prompt_logprobs is not None and unplanned:
            return False  # each prompt position must pass through a step
        return not p.has_penalties or not self.output_token_ids

    @property
    def last_token(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
