"""The simulated runs' requests: `bench serve`'s lengths and arrival times for one seed.

Lengths and prompt tokens come from `bench offline`'s `draw_requests` (the streams and order of
`bench serve`, so one seed gives the same input and output lengths both benchmarks send, and its
shapers: a shared prompt prefix, long prompts mixed in); arrival times from
`WorkloadConfig.arrival_times`, the same gap pattern rescaled to each rate. Every rate of a sweep
runs on a fresh simulated engine, so reusing the prompts across rates finds nothing in the
prefix cache that an earlier rate left, like `bench serve --sweep-prompts fresh`.
"""

from __future__ import annotations

import dataclasses

from nori_jax.bench.offline import OfflineConfig, draw_requests
from nori_jax.bench.workload import WorkloadConfig
from nori_jax.plan.simulator import SimRequest


@dataclasses.dataclass(frozen=True)
class Drawn:
    prompts: list[list[int]]
    output_lens: list[int]
    is_long: list[bool]

    @property
    def num_tokens(self) -> int:
        return sum(len(p) for p in self.prompts) + sum(self.output_lens)


def draw(shaping: OfflineConfig, vocab_size: int, max_model_len: int) -> Drawn:
    """The measured requests (warm-up ones dropped: a simulated engine has nothing to warm)."""
    reqs = draw_requests(shaping, vocab_size, max_model_len)
    k = shaping.workload.warmup_requests
    return Drawn(reqs.prompts[k:], reqs.output_lens[k:], reqs.is_long[k:])


def at_rate(drawn: Drawn, workload: WorkloadConfig, rate: float) -> list[SimRequest]:
    arrivals = workload.arrival_times(len(drawn.prompts), rate)
    return [
        SimRequest(p, int(o), float(t))
        for p, o, t in zip(drawn.prompts, drawn.output_lens, arrivals, strict=True)
    ]
