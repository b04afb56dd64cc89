"""Fixed room in the step's buffer that the running requests share: logit_bias entries
(LOGIT_BIAS_CAPACITY for all rows, which min_tokens's banned stop ids also take). A fixed size
keeps the buffer one shape and one transfer, so the scheduler admits a request only while what it
needs fits beside what the running requests hold (core/step_layout.py, docs/scheduling.md)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from nori_jax.core.request import Request
from nori_jax.core.step_layout import LOGIT_BIAS_CAPACITY


class StepRoom:
    def __init__(self, name: str, capacity: int, need: Callable[[Request], int]):
        self.name, self.capacity, self.need = name, capacity, need
        self.used = 0  # by the running requests

    def fits(self, req: Request) -> bool:
        n = self.need(req)
        return not n or self.used + n <= self.capacity

    def check(self, running: Sequence[Request]) -> None:
        """Invariant: `used` is what the running requests need, within the capacity."""
        assert self.used == sum(map(self.need, running)), self.name
        assert self.used <= self.capacity, self.name


def step_rooms() -> tuple[StepRoom, ...]:
    return (
        StepRoom(
            "logit_bias entries",
            LOGIT_BIAS_CAPACITY,
            lambda r: len(r.params.logit_bias or ()) + len(r.min_tokens_stop_ids),
        ),
    )
