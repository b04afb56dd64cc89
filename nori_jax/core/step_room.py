"""Fixed room in the step's buffer that the running requests share: logit_bias entries
(LOGIT_BIAS_CAPACITY for all rows, which min_tokens's banned stop ids also take), top-logprobs
places (TOP_LOGPROBS_ROWS rows) and penalty places (PENALTY_PLACES, each also a row of token
counts the device keeps between steps). A fixed size keeps the buffer one shape and one transfer,
so the scheduler admits a request only while what it needs fits beside what the running requests
hold (core/step_layout.py, docs/scheduling.md)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from nori_jax.core.request import Request
from nori_jax.core.step_layout import LOGIT_BIAS_CAPACITY, PENALTY_PLACES, TOP_LOGPROBS_ROWS


class StepRoom:
    def __init__(self, name: str, capacity: int, need: Callable[[Request], int]):
        self.name, self.capacity, self.need = name, capacity, need
        self.used = 0  # by the running requests

    def fits(self, req: Request) -> bool:
        n = self.need(req)
        return not n or self.used + n <= self.capacity

    def join(self, req: Request) -> None:
        """`req` joins the running batch (after `fits` said yes)."""
        self.used += self.need(req)

    def leave(self, req: Request) -> None:
        """`req` leaves the running batch (finished, preempted, handed off)."""
        self.used -= self.need(req)

    def check(self, running: Sequence[Request]) -> None:
        """Invariant: `used` is what the running requests need, within the capacity."""
        assert self.used == sum(map(self.need, running)), self.name
        assert self.used <= self.capacity, self.name


class PenaltyPlaces(StepRoom):
    """Penalty places: each running request with a penalty holds its own place (index) from
    joining the batch to leaving it (`Request.penalty_place`). A preempted request gives its
    place back and takes a fresh one when it runs again, whose counts its recomputation rebuilds
    (docs/scheduling.md)."""

    def __init__(self, capacity: int = PENALTY_PLACES):
        super().__init__("penalty places", capacity, lambda r: int(r.params.has_penalties))
        self._free = list(range(capacity - 1, -1, -1))

    def join(self, req: Request) -> None:
        super().join(req)
        if self.need(req):
            req.penalty_place = self._free.pop()

    def leave(self, req: Request) -> None:
        super().leave(req)
        if req.penalty_place is not None:
            self._free.append(req.penalty_place)
            req.penalty_place = None

    def check(self, running: Sequence[Request]) -> None:
        super().check(running)
        held = [r.penalty_place for r in running if r.penalty_place is not None]
        assert len(held) == self.used and len(set(held)) == len(held), "penalty places shared"
        assert sorted(held + self._free) == list(range(self.capacity)), "penalty place lost"


def step_rooms() -> tuple[StepRoom, ...]:
    return (
        StepRoom(
            "logit_bias entries",
            LOGIT_BIAS_CAPACITY,
            lambda r: len(r.params.logit_bias or ()) + len(r.min_tokens_stop_ids),
        ),
        StepRoom("top-logprobs places", TOP_LOGPROBS_ROWS, lambda r: int(bool(r.params.logprobs))),
        PenaltyPlaces(),
    )
