"""How the compute warpgroups of a prefill tile take turns on the tensor cores (tuning.pingpong).

Each KV block is two tensor-core segments per warpgroup, `Q K^T` and `P V`, with the softmax in
between. Taking turns keeps one warpgroup's softmax under the others' matmuls instead of letting
them all reach the softmax at once (FlashAttention-3's warpgroup scheduling).

Two warpgroups (`Rendezvous`): both arrive at and wait on one shared barrier twice per block,
warpgroup 1 one turn behind, so between two rendezvous one warpgroup runs `P V` of block b and
`Q K^T` of block b+1 while the other runs its softmax.

Three warpgroups (`Ring`): a token passes around the ring once per segment: a warpgroup waits
for the token on its own barrier before it issues a segment and passes it to the next warpgroup
as soon as the segment is issued (not finished). The tensor cores then see `Q K^T` of warpgroups
0, 1, 2, then `P V` of 0, 1, 2, and each softmax has two other segments' time to run.

Every warpgroup takes the same number of turns per prefill item (a block it skips takes its
turns too), so the order holds across items; decode items never take turns.
"""

from __future__ import annotations

from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu


class NoTurns:
    """No ping-pong: every hook is a no-op."""

    def start(self) -> None: ...

    def finish(self) -> None: ...

    def item_start(self) -> None: ...

    def item_end(self) -> None: ...

    def before_qk(self) -> None: ...

    def after_qk_issue(self) -> None: ...

    def before_pv(self, wait_v, values: tuple) -> tuple:
        wait_v()
        return values

    def after_pv_issue(self) -> None: ...

    def skip_block(self) -> None: ...


class Rendezvous(NoTurns):
    """Two warpgroups on one barrier of two arrivals (module docstring)."""

    def __init__(self, barrier, wg):
        self.barrier, self.wg = barrier, wg

    def _take(self) -> None:
        plgpu.barrier_arrive(self.barrier)
        plgpu.barrier_wait(self.barrier)

    def item_start(self) -> None:  # warpgroup 1 starts a turn behind ...
        pl.when(self.wg == 1)(self._take)

    def item_end(self) -> None:  # ... and warpgroup 0 takes the turn it owes at the end
        pl.when(self.wg == 0)(self._take)

    def after_qk_issue(self) -> None:  # the other's P V may run
        self._take()

    def before_pv(self, wait_v, values: tuple) -> tuple:
        # Hand the turn over once the softmax is issued (the fence keeps it before the arrival),
        # then wait for V and for the turn to come back.
        values = lax.optimization_barrier(values)
        plgpu.barrier_arrive(self.barrier)
        wait_v()
        plgpu.barrier_wait(self.barrier)
        return values

    def skip_block(self) -> None:
        self._take()
        self._take()


class Ring(NoTurns):
    """Three (or more) warpgroups, barrier i of one arrival per warpgroup i (module docstring)."""

    def __init__(self, barriers, wg, num_wgs: int):
        self.mine = barriers.at[wg]
        self.next = barriers.at[lax.rem(wg + 1, num_wgs)]
        self.barriers, self.wg = barriers, wg

    def start(self) -> None:  # warpgroup 0 holds the token first
        pl.when(self.wg == 0)(lambda: plgpu.barrier_arrive(self.barriers.at[0]))

    def finish(self) -> None:  # the token ends where it started: observe its last completion
        pl.when(self.wg == 0)(lambda: plgpu.barrier_wait(self.barriers.at[0]))

    def before_qk(self) -> None:
        plgpu.barrier_wait(self.mine)

    def after_qk_issue(self) -> None:
        plgpu.barrier_arrive(self.next)

    def before_pv(self, wait_v, values: tuple) -> tuple:
        values = lax.optimization_barrier(values)  # the softmax stays before the wait
        wait_v()
        plgpu.barrier_wait(self.mine)
        return values

    def after_pv_issue(self) -> None:
        plgpu.barrier_arrive(self.next)

    def skip_block(self) -> None:
        for _ in range(2):
            plgpu.barrier_wait(self.mine)
            plgpu.barrier_arrive(self.next)


def make_turns(st, turn_barriers, wg) -> NoTurns:
    if turn_barriers is None:
        return NoTurns()
    if st.tuning.compute_wgs == 2:
        return Rendezvous(turn_barriers, wg)
    return Ring(turn_barriers, wg, st.tuning.compute_wgs)
