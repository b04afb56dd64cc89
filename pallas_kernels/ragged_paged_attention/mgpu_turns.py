"""How the compute warpgroups of a prefill tile take turns on the tensor cores (tuning.pingpong).

Each KV block is two tensor-core segments per warpgroup, `Q K^T` and `P V`, with the softmax in
between. Taking turns keeps one warpgroup's softmax under the others' matmuls instead of letting
them all reach the softmax at once (FlashAttention-3's warpgroup scheduling).

Two warpgroups (`Rendezvous`, the only form): both arrive at and wait on one shared barrier
twice per block, warpgroup 1 one turn behind, so between two rendezvous one warpgroup runs `P V`
of block b and `Q K^T` of block b+1 while the other runs its softmax. Both take the same number
of turns per prefill item (a block one skips takes its turns too); decode items never take
turns. (Three warpgroups take no turns: a token ring among them measured slower than none,
docs/benchmarks.md run 7.)
"""

from __future__ import annotations

from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu


class NoTurns:
    """No ping-pong: every hook is a no-op."""

    def item_start(self) -> None: ...

    def item_end(self) -> None: ...

    def after_qk_issue(self) -> None: ...

    def before_pv(self, wait_v, values: tuple) -> tuple:
        wait_v()
        return values

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


def make_turns(turn_barrier, wg) -> NoTurns:
    return NoTurns() if turn_barrier is None else Rendezvous(turn_barrier, wg)
