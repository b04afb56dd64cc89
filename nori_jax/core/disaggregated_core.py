"""Prefill/decode disaggregation: prefill engine cores hand each request, once its first token is
sampled, to a decode engine core, its KV pages moved between their pools.

JAX-free, like the engine cores it drives: the move itself is a `PageMover`'s
(executor/kv_transfer.py on devices; a fake in tests). It offers the engine core's interface
(add_request / step / drain / abort / has_unfinished / has_in_flight), so the frontends
(`LLMEngine`, the engine-core process) run it unchanged.

A request's life here:
  1. `add_request` queues it on the least loaded prefill core. Its scheduler (`hand_off`) runs
     the prompt with continuous batching, chunked prefill and prefix caching, samples the first
     token, then parks the request in `handed_off`, its pages kept.
  2. After every step, each handed-off request (oldest first) goes to the least loaded decode core
     with room for it (a slot, its pages, the KV headroom). The decode allocator first lends the
     prompt's full pages it already holds in its prefix cache; fresh pages take the rest, the
     mover copies the prefill pages into them, and the decode scheduler admits the request with
     its prompt computed (`Scheduler.add_arrived`): it decodes from the next step on. Only then
     are the prefill pages freed (full ones stay in the prefill prefix cache).
  3. No decode core has room: the request waits, its KV on the prefill side (backpressure: the
     prefill pool fills and prefill admission slows). A move that raises frees what the decode
     side allocated and leaves the request first in line for the next step; after
     `max_transfer_attempts` failures it is recomputed on a decode core instead (queued there
     with its first token, as a preempted request is). Nothing is dropped either way.
  4. A decode core preempts as any engine does: the request recomputes on that decode core
     (mostly from its prefix cache, which holds the moved full pages once they are published), so
     a preemption never sends work back to the prefill side.

Outputs of every core are merged into one `EngineCoreOutputs` per step; the moves come back in
`transfers` when their pages have landed (the mover is polled each step; `drain` waits).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Protocol

from nori_jax.core.engine_core import EngineCore, EngineCoreRequest, StepTimes
from nori_jax.core.outputs import EngineCoreOutputs, FinishedRequest, KVTransfer, StepStats
from nori_jax.core.request import Request
from nori_jax.core.step_shapes import StepShapes
from nori_jax.core.top_logprob_rows import TopLogprobRows


class PageMover(Protocol):
    num_recompiles: int  # programs built after warm-up; anything but 0 is a bug
    bytes_per_page: int  # one page index, all layers

    def move(self, src: int, dst: int, src_pages: list[int], dst_pages: list[int]) -> Any:
        """Copy pages of prefill replica `src` into pages of decode replica `dst`; a handle."""

    def is_done(self, handle: Any) -> bool: ...

    def wait(self, handle: Any) -> None: ...


@dataclasses.dataclass
class _InFlight:
    """A move whose pages may still be on their way."""

    request_id: str
    ready_since: float  # the request's first token on the host
    num_pages: int
    num_bytes: int
    handle: Any


def _moved_request(req: Request, pages: list[int], num_cached_pages: int) -> Request:
    """The decode side's copy of a handed-off request: same tokens, settings and stage times."""
    return Request(
        request_id=req.request_id,
        prompt_token_ids=req.prompt_token_ids,
        params=req.params,
        seed=req.seed,
        eos_token_ids=req.eos_token_ids,
        times=req.times,
        output_token_ids=list(req.output_token_ids),
        pages=pages,
        num_computed_tokens=req.num_computed_tokens if pages else 0,
        num_cached_tokens=req.num_cached_tokens,
        num_registered_pages=num_cached_pages,
        page_hashes=list(req.page_hashes),
        num_preemptions=req.num_preemptions,
        final_token_ids=req.final_token_ids,
        priority=req.priority,
        # its prompt's logprobs came from the prefill side: a recomputation plans none again
        prompt_logprobs_planned=req.prompt_logprobs_planned,
    )


def _joined_logprobs(outs: list[EngineCoreOutputs]) -> bytes:
    """The cores' logprob columns end to end, as their rows are; a core that gave none (never,
    with a real executor) contributes zeros so the column stays aligned."""
    if not any(o.logprob_bytes for o in outs):
        return b""
    return b"".join(o.logprob_bytes or bytes(4 * len(o.request_ids)) for o in outs)


def _load(core: EngineCore) -> int:
    s = core.scheduler
    return len(s.running) + s.num_waiting + len(s.handed_off) + len(s.arrived)


class DisaggregatedCore:
    def __init__(
        self,
        prefill: list[EngineCore],
        decode: list[EngineCore],
        mover: PageMover,
        *,
        max_transfer_attempts: int = 3,
    ):
        if not prefill or not decode:
            raise ValueError(f"need prefill and decode cores, got {len(prefill)} + {len(decode)}")
        if max_transfer_attempts < 1:
            raise ValueError(f"max_transfer_attempts={max_transfer_attempts} must be >= 1")
        for core in prefill:
            assert core.scheduler.hand_off, "a prefill core's scheduler must hand requests off"
        self.prefill, self.decode, self.mover = list(prefill), list(decode), mover
        self.max_transfer_attempts = max_transfer_attempts
        self._failures: dict[str, int] = {}  # request id -> failed moves so far
        self._in_flight: list[_InFlight] = []
        self._transfers: list[KVTransfer] = []  # reported with the next outputs
        self._seen_mover_compiles = 0
        self.num_transfers = self.num_transfer_failures = self.num_recomputed = 0

    @property
    def cores(self) -> list[EngineCore]:
        return self.prefill + self.decode

    # ---- the engine core's interface --------------------------------------------------------

    def add_request(self, r: EngineCoreRequest) -> None:
        if any(r.request_id in c.scheduler.requests for c in self.cores):
            raise ValueError(f"request_id={r.request_id!r} is already in use")
        min(self.prefill, key=_load).add_request(r)

    def abort(self, request_id: str, reason: str = "abort") -> FinishedRequest | None:
        for core in self.cores:
            finished = core.abort(request_id, reason)
            if finished is not None:
                self._failures.pop(request_id, None)
                return finished
        return None

    def has_unfinished(self) -> bool:
        return any(c.has_unfinished() for c in self.cores)

    @property
    def has_in_flight(self) -> bool:
        return bool(self._in_flight) or any(c.has_in_flight for c in self.cores)

    @property
    def num_recompiles(self) -> int:
        return sum(c.num_recompiles for c in self.cores) + self.mover.num_recompiles

    @property
    def step_times(self) -> StepTimes:
        """Every core's stage times, summed."""
        total = StepTimes()
        for core in self.cores:
            for f in dataclasses.fields(StepTimes):
                setattr(total, f.name, getattr(total, f.name) + getattr(core.step_times, f.name))
        return total

    @property
    def step_shapes(self) -> StepShapes:
        """Every core's step shapes, merged (each core's own wall per step)."""
        return StepShapes.merged([core.step_shapes for core in self.cores])

    def step(self) -> EngineCoreOutputs:
        """Step every core, launching all before fetching any so that their devices run
        together (prefill first, so their first tokens come out before the decode cores' second
        ones); then move what the prefill cores handed off: it decodes from the next step on,
        while the decode devices run this one."""
        t0 = time.perf_counter()
        pending = [core.launch_step() for core in self.cores]
        outs = [core.complete_step(p) for core, p in zip(self.cores, pending, strict=True)]
        for src, core in enumerate(self.prefill):
            self._move_handed_off(src, core)
        self._collect_landed(wait=False)
        return self._merge(outs, time.perf_counter() - t0)

    def drain(self) -> EngineCoreOutputs:
        outs = [core.drain() for core in self.cores]
        self._collect_landed(wait=True)
        return self._merge(outs, 0.0)

    # ---- moving requests --------------------------------------------------------------------

    def _move_handed_off(self, src: int, core: EngineCore) -> None:
        sched = core.scheduler
        while sched.handed_off:
            req = sched.handed_off[0]
            # Preempted before its first token landed: nothing to move. With penalties: the
            # decode side's counts are built from the tokens its own steps see, so it computes
            # the prompt again rather than taking the moved KV.
            if not req.pages or req.params.has_penalties:
                self._recompute(sched, req)
                continue
            candidates = [
                j
                for j, d in enumerate(self.decode)
                if d.scheduler.has_room_for_arrival(len(req.pages))
            ]
            if not candidates:
                return  # no room on the decode side yet: its KV waits on the prefill side
            dst = min(candidates, key=lambda j: _load(self.decode[j]))
            try:
                self._move(src, dst, req)
            except Exception as e:  # noqa: BLE001 - a failed move loses nothing: retry or recompute
                self.num_transfer_failures += 1
                attempts = self._failures[req.request_id] = (
                    self._failures.get(req.request_id, 0) + 1
                )
                self._transfers.append(
                    KVTransfer(req.request_id, 0.0, 0, 0, f"{type(e).__name__}: {e}")
                )
                if attempts < self.max_transfer_attempts:
                    return  # first in line again at the next step
                self._recompute(sched, req)
                continue
            self._failures.pop(req.request_id, None)
            sched.release_handed_off(req)

    def _move(self, src: int, dst: int, req: Request) -> None:
        """Move `req`'s KV into decode core `dst` and admit it there; on an exception, the decode
        side is as it was and the request still waits on the prefill side."""
        dsched = self.decode[dst].scheduler
        alloc = dsched.allocator
        ps = alloc.page_size
        # Full prompt pages the decode side already caches need no copy (prefix caching).
        cached = alloc.lookup(req.page_hashes[: req.num_computed_tokens // ps])
        fresh = alloc.allocate(len(req.pages) - len(cached))
        if fresh is None:
            alloc.free(cached)
            raise RuntimeError(f"decode replica {dst} ran out of pages")  # has_room_for_arrival
        moved = req.pages[len(cached) :]
        try:
            handle = self.mover.move(src, dst, moved, fresh) if moved else None
            dsched.add_arrived(_moved_request(req, cached + fresh, len(cached)))
        except BaseException:
            alloc.free(cached + fresh)
            raise
        self.num_transfers += 1
        first_token = req.times.first_token or time.monotonic()
        num_bytes = len(moved) * self.mover.bytes_per_page
        self._in_flight.append(
            _InFlight(req.request_id, first_token, len(moved), num_bytes, handle)
        )

    def _recompute(self, sched, req: Request) -> None:
        """Fall back: the request, with its first token, is recomputed on a decode core."""
        sched.release_handed_off(req)
        self._failures.pop(req.request_id, None)
        self.num_recomputed += 1
        min(self.decode, key=_load).scheduler.add_recompute(_moved_request(req, [], 0))

    def _collect_landed(self, wait: bool) -> None:
        still = []
        for t in self._in_flight:
            if t.handle is not None and not self.mover.is_done(t.handle):
                if not wait:
                    still.append(t)
                    continue
                self.mover.wait(t.handle)
            seconds = time.monotonic() - t.ready_since
            self._transfers.append(KVTransfer(t.request_id, seconds, t.num_bytes, t.num_pages))
        self._in_flight = still

    # ---- outputs ----------------------------------------------------------------------------

    def _merge(self, outs: list[EngineCoreOutputs], step_s: float) -> EngineCoreOutputs:
        merged = EngineCoreOutputs(
            [rid for o in outs for rid in o.request_ids],
            b"".join(o.token_bytes for o in outs),
            _joined_logprobs(outs),
            [f for o in outs for f in o.finished],
            [f for o in outs for f in o.first_tokens],
            top_logprobs=TopLogprobRows.concat([o.top_logprobs for o in outs]),
            prompt_logprobs={k: v for o in outs for k, v in o.prompt_logprobs.items()},
        )
        merged.transfers, self._transfers = self._transfers, []
        stats = [o.stats for o in outs if o.stats is not None]
        if stats:
            total = lambda name: sum(getattr(s, name) for s in stats)  # noqa: E731
            allocators = [c.scheduler.allocator for c in self.cores]
            compiles = self.mover.num_recompiles
            merged.stats = StepStats(
                num_running=total("num_running"),
                num_waiting=total("num_waiting"),
                kv_usage=sum(a.num_used_pages for a in allocators)
                / sum(a.num_usable_pages for a in allocators),
                num_generated_tokens=total("num_generated_tokens"),
                num_preemptions=total("num_preemptions"),
                prefix_cache_hits=total("prefix_cache_hits"),
                prefix_cache_queries=total("prefix_cache_queries"),
                num_recompiles=total("num_recompiles") + compiles - self._seen_mover_compiles,
                schedule_seconds=total("schedule_seconds"),
                step_seconds=step_s,
                num_steps=max(s.num_steps for s in stats),
                launches=[launch for s in stats for launch in s.launches],
            )
            self._seen_mover_compiles = compiles
        return merged

    def check_invariants(self) -> None:
        """For tests: every core's own invariants, and each live request in exactly one core."""
        seen: set[str] = set()
        for core in self.cores:
            core.scheduler.check_invariants()
            ids = set(core.scheduler.requests)
            assert not ids & seen, f"requests in two cores: {sorted(ids & seen)}"
            seen |= ids
