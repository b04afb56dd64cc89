"""What-if: prefill and decode on separate engines, the KV moved between them.

Prefill replicas run each request's prompt and sample its first token (the client's first
token); the request's KV then travels to a decode replica (`KVTransfer`: latency + bytes over
bandwidth), where it arrives as a new request whose prompt is the old prompt plus that token.
The transferred pages are put in the decode engine's prefix cache just before the request is
added, so its scheduler admits it with those pages cached and computes only the last partial
page: the real scheduler on both sides, and no recompute of the prompt. If the decode pool has
no free page to hold them the request recomputes (counted in `kv_recomputed`).

Requests are dealt round-robin to the prefill replicas in arrival order and to the decode
replicas in the order their KV lands, as a stateless load balancer would.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from nori_jax.bench.run import RunResult
from nori_jax.core.paging import ROOT_HASH, page_hash
from nori_jax.plan.calibration import KVTransfer
from nori_jax.plan.simulator import (
    NO_FRONTEND,
    Frontend,
    SimEngine,
    SimRequest,
    SimStats,
    run_result,
    simulate,
)
from nori_jax.plan.step_model import StepCosts
from nori_jax.plan.virtual_device import OUTPUT_TOKEN


@dataclasses.dataclass(frozen=True)
class Side:
    engine: SimEngine
    costs: StepCosts
    replicas: int

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas={self.replicas} must be >= 1")


@dataclasses.dataclass
class DisaggregatedResult:
    run: RunResult  # of the whole path, as the client sees it
    prefill: list[SimStats]
    decode: list[SimStats]
    kv_recomputed: int
    mean_transfer_s: float


def inject_kv(core, prompt: list[int]) -> bool:
    """Place the full pages of `prompt` in the core's prefix cache (as if transferred there)."""
    allocator = core.scheduler.allocator
    ps = allocator.page_size
    n = (len(prompt) - 1) // ps  # admission always leaves the last token to compute
    if n == 0:
        return True
    if not allocator.enable_prefix_caching:
        raise ValueError("disaggregation needs prefix caching on the decode engine")
    pages = allocator.allocate(n)
    if pages is None:
        return False
    parent = ROOT_HASH
    for j, page in enumerate(pages):
        parent = page_hash(parent, prompt[j * ps : (j + 1) * ps])
        allocator.register(page, parent)
    allocator.free(pages)  # free but cached: admission finds them
    return True


def simulate_disaggregated(
    prefill: Side,
    decode: Side,
    requests: Sequence[SimRequest],
    transfer: KVTransfer,
    kv_bytes_per_token: int,
    *,
    request_rate: float,
    percentiles: Sequence[float] = (99.0,),
    goodput_slos_ms: Mapping[str, float] | None = None,
    frontend: Frontend = NO_FRONTEND,
) -> DisaggregatedResult:
    if frontend.enabled:
        raise ValueError("the frontend stage is not modelled with disaggregation")
    n = len(requests)
    first: dict[int, float] = {}
    rejected: dict[int, float] = {}
    prefill_stats = []
    for j in range(prefill.replicas):
        idx = list(range(j, n, prefill.replicas))
        side = [SimRequest(requests[i].prompt, 1, requests[i].arrival_s) for i in idx]
        res = simulate(prefill.engine, prefill.costs, side, request_rate=request_rate)
        prefill_stats.append(res.stats)
        for i, r, ts in zip(idx, res.run.results, res.token_times, strict=True):
            if r.success:
                first[i] = ts[0]
            else:
                rejected[i] = requests[i].arrival_s + r.latency_s
    transfers = {i: transfer.seconds(len(requests[i].prompt) * kv_bytes_per_token) for i in first}
    ready = sorted((first[i] + transfers[i], i) for i in first if requests[i].output_len > 1)
    times: list[list[float]] = [[first[i]] if i in first else [] for i in range(n)]
    decode_stats, recomputed = [], 0
    for j in range(decode.replicas):
        mine = ready[j :: decode.replicas]
        side = [
            SimRequest(requests[i].prompt + [OUTPUT_TOKEN], requests[i].output_len - 1, t)
            for t, i in mine
        ]

        def place(core, k, req):
            nonlocal recomputed
            recomputed += not inject_kv(core, req.prompt)

        res = simulate(decode.engine, decode.costs, side, request_rate=request_rate, prepare=place)
        decode_stats.append(res.stats)
        for (t, i), r, ts in zip(mine, res.run.results, res.token_times, strict=True):
            if r.success:
                times[i].extend(ts)
            else:
                rejected[i] = t + r.latency_s
    run = run_result(requests, times, rejected, request_rate, percentiles, goodput_slos_ms)
    mean_transfer = sum(transfers.values()) / max(len(transfers), 1)
    return DisaggregatedResult(run, prefill_stats, decode_stats, recomputed, mean_transfer)
