"""What the scheduler decides for one step: logical rows, plus the persistent batch's changes.

The scheduler knows requests, pages and progress; the plan builder knows the step's array layout.
This is what passes between them (and back to `Scheduler.update` with the step's samples).
Decode rows (one token each) come first, as numpy arrays over their slots; prefill chunks follow,
a few rows with many tokens each.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from nori_jax.core.request import Request


@dataclasses.dataclass(frozen=True)
class Acquire:
    """A request took a slot: its sampling settings and its pages so far go into that row."""

    slot: int
    pages: list[int]
    temperature: float
    top_p: float
    top_k: int  # 0 = off
    seed: int
    min_p: float = 0.0  # 0 = off
    logit_bias: dict[int, float] | None = None
    # Banned (a bias of -inf) while the row samples an output index below min_tokens.
    min_tokens: int = 0
    min_tokens_stop_ids: tuple[int, ...] = ()
    # Penalties (presence, frequency, repetition): the device keeps its slot's token counts.
    has_penalties: bool = False
    penalties: tuple[float, float, float] = (0.0, 0.0, 1.0)
    prompt_len: int = 0
    # repetition_penalty: the distinct ids of its prompt's tokens taken from the prefix cache
    prompt_marks: np.ndarray | None = None
    # Tokens known when it took the slot: those past the prompt are outputs the step recounts as
    # their recomputation passes (after a preemption); later ones are counted as sampled.
    count_from: int = 0


@dataclasses.dataclass(frozen=True)
class AddPages:
    slot: int
    start: int  # index of the first new page in the request's page list
    pages: list[int]


@dataclasses.dataclass(frozen=True)
class Release:
    """The slot's request finished or was preempted: its row must never be read again."""

    slot: int


BatchEvent = Acquire | AddPages | Release


@dataclasses.dataclass(frozen=True)
class PrefillRow:
    slot: int
    start: int  # position of the chunk's first token
    token_ids: np.ndarray  # int32[n] (a view of the request's prompt array where it can be)
    sample_index: int  # output index sampled if the chunk reaches the end of the known tokens


@dataclasses.dataclass(frozen=True)
class PromptLogprobRows:
    """Prompt positions of one row whose logprobs the step computes, each in a logit row of its
    own past the step's rows (core/step_layout.py, `prompt_logprob_rows`)."""

    row: int  # the step's row holding them
    chunk_start: int  # position of the row's first token
    first: int  # the first of these positions
    targets: np.ndarray  # int32[count]: the prompt token after each position
    request: Request

    @property
    def count(self) -> int:
        return len(self.targets)


@dataclasses.dataclass
class SchedulerOutput:
    """One step's rows. Row i < num_decodes is decode row i; then one row per prefill chunk."""

    decode_slots: np.ndarray  # int32[D], oldest request first
    decode_positions: np.ndarray  # int32[D]: position of the row's token
    decode_input_ids: np.ndarray  # int32[D]: 0 where the id is still on the device
    decode_prev_index: np.ndarray  # int32[D]: row of the previous step holding the id, or -1
    decode_sample_index: np.ndarray  # int32[D]
    prefills: list[PrefillRow]
    events: list[BatchEvent]  # to apply, in order, before building this step's arrays
    # Host bookkeeping per row (decodes, then prefills), read back by Scheduler.update.
    row_requests: list[Request]
    row_slots: np.ndarray  # int32[N]
    row_epochs: np.ndarray  # int64[N]: the slot's epoch when planned (a reused slot differs)
    row_num_tokens: np.ndarray  # int32[N]
    row_samples: np.ndarray  # bool[N]: does the row produce an output token?
    num_tokens: int
    # A multi-step launch (decode rows only) runs `num_steps` decode steps on the device; row i
    # computes the first `decode_steps[i]` of them (the rest are dropped: max_tokens or the
    # context ends it first). One step: num_steps 1, decode_steps None.
    num_steps: int = 1
    decode_steps: np.ndarray | None = None  # int32[D]
    # The sampling rows of requests with logprobs >= 1, in row order, as the step buffer lists
    # them (core/step_layout.py, `top_rows`): the top-logprobs output's row p is row top_rows[p]'s.
    top_rows: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int32))
    # Rows of requests with prompt_logprobs and the positions whose logprobs the step computes.
    prompt_logprobs: list[PromptLogprobRows] = dataclasses.field(default_factory=list)

    @property
    def num_decodes(self) -> int:
        return len(self.decode_slots)

    @property
    def num_rows(self) -> int:
        return len(self.row_requests)

    @property
    def request_ids(self) -> list[str]:
        return [r.request_id for r in self.row_requests]

    @property
    def num_scheduled_tokens(self) -> list[int]:
        return self.row_num_tokens.tolist()
