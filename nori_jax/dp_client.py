"""DataParallelClient: data-parallel replicas, one engine-core process each, behind one client.

What `nori-jax serve --data-parallel-size N` runs: N `EngineCoreClient`s, client i starting the
engine-core process of replica i on that replica's devices only (CUDA_VISIBLE_DEVICES narrowed
to them; core_client.replica_env), and this client in front with the same engine-client API
(engine_client.py), so the server does not know there are several. A `ReplicaRouter`
(core/replica_router.py) picks each request's replica: the least loaded one, or the one that
served the request's prefix (its prefix cache holds it) while that one is not too busy.

The replicas start together, except where replica 0 may have to write the parameter cache
(converted weights, `param_cache`): then it starts first, alone, and the others restore what it
wrote, so no two processes ever write one cache entry.

Failure is per replica: when one engine-core process dies, its client fails that replica's
requests (EngineDeadError) and restarts it (counted in `nori:engine_restarts_total{replica=...}`),
while the other replicas go on serving; new requests go to the replicas that serve meanwhile.
/health answers 200 while at least one replica serves.

Metrics: one view, each series labelled `replica` (replica_metrics.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
import uuid
from typing import Any, NoReturn

from nori_jax.async_engine import (
    EngineDeadError,
    EngineStoppedError,
    RequestStream,
    RequestTimeoutError,
)
from nori_jax.client_base import StreamingClient, check_timeout
from nori_jax.core.replica_router import ReplicaRouter, RouterConfig
from nori_jax.core_client import EngineCoreClient
from nori_jax.engine_config import EngineConfig
from nori_jax.replica_metrics import ReplicaMetrics
from nori_jax.sampling_params import SamplingParams
from nori_jax.tokenizer import Tokenizer
from nori_jax.weight_control import EngineBusyError

logger = logging.getLogger(__name__)

CONTROL_POLL_S = 0.005  # how often a request waiting for a weight operation looks again


class DataParallelClient(StreamingClient):
    # The weight operation running (control), if any: new requests wait for its end, so that
    # none lands on a replica between the idle check and the operation.
    _control_op: str | None = None

    def __init__(self, config: EngineConfig, **client_options: Any):
        """Start every replica's engine-core process; returns once all are ready.
        `client_options` go to each EngineCoreClient (startup_timeout_s, log_level,
        max_restarts, restart_window_s)."""
        n = config.mesh.data
        if config.mesh.disaggregated or n < 2:
            raise ValueError(
                f"mesh {config.mesh.describe()}: DataParallelClient runs 2 or more colocated "
                "replicas"
            )
        self.config = config
        self.router = ReplicaRouter(
            n,
            RouterConfig(
                page_size=config.scheduler.page_size,
                max_imbalance_tokens=config.mesh.prefix_affinity_max_imbalance_tokens,
            ),
        )

        def start(i: int) -> EngineCoreClient:
            return EngineCoreClient(
                config, replica=i, on_request_done=self.router.release, **client_options
            )

        # Replica 0 alone first where it may write the parameter cache (one writer per entry);
        # the others then restore from it. Dummy weights have no such entry: all start at once.
        staggered = config.param_cache and config.load_format != "dummy"
        self.clients: list[EngineCoreClient] = [start(0)] if staggered else []
        try:
            rest = range(len(self.clients), n)
            with concurrent.futures.ThreadPoolExecutor(len(rest)) as pool:
                futures = [pool.submit(start, i) for i in rest]
                concurrent.futures.wait(futures)
            for f in futures:
                if f.exception() is None:
                    self.clients.append(f.result())
            for f in futures:
                if f.exception() is not None:
                    raise f.exception()
        except BaseException:
            for c in self.clients:
                c.stop()
            raise
        first = self.clients[0]
        self.tokenizer: Tokenizer | None = first.tokenizer
        self.max_model_len = first.max_model_len
        self.metrics = ReplicaMetrics([c.metrics for c in self.clients])

    # ---- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        for c in self.clients:
            c.start()

    @property
    def is_started(self) -> bool:
        return all(c.is_started for c in self.clients)

    @property
    def is_healthy(self) -> bool:
        """True while at least one replica serves."""
        return any(c.is_healthy for c in self.clients)

    @property
    def dead_reason(self) -> str | None:
        down = [
            f"replica {i}: {c.dead_reason}"
            for i, c in enumerate(self.clients)
            if c.dead_reason is not None
        ]
        return "; ".join(down) or None

    @property
    def num_in_flight(self) -> int:
        return sum(c.num_in_flight for c in self.clients)

    @property
    def pids(self) -> list[int | None]:
        """Each replica's engine-core process id, in replica order."""
        return [c.pid for c in self.clients]

    @property
    def num_restarts(self) -> int:
        return sum(c.num_restarts for c in self.clients)

    async def shutdown(self, drain_timeout_s: float | None = None) -> None:
        await asyncio.gather(*(c.shutdown(drain_timeout_s) for c in self.clients))

    def stop(self, timeout_s: float = 30.0) -> None:
        for c in self.clients:
            c.stop(timeout_s)

    # ---- requests ---------------------------------------------------------------------------

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return self.clients[0].tokenize(prompt)

    def replica_of(self, request_id: str) -> int | None:
        """The replica serving a request (None once it is done, or if unknown)."""
        return self.router.owner(request_id)

    async def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        timeout_s: float | None = None,
        stream: bool = True,
        priority: int = 0,
    ) -> RequestStream:
        """Route a request to a replica and queue it there (EngineCoreClient.add_request says
        what it raises); EngineStoppedError while no replica serves. A request that arrives
        during a weight operation waits for its end, within its own `timeout_s`
        (RequestTimeoutError past it; the replica gets what is left)."""
        check_timeout(timeout_s)
        params.validate()
        rid = request_id or f"req-{uuid.uuid4().hex}"
        timeout_s = await self._wait_for_control(rid, timeout_s)
        ids = prompt if isinstance(prompt, list) else self.tokenize(prompt)
        cost = min(len(ids) + params.max_tokens, self.max_model_len)
        serving = [i for i, c in enumerate(self.clients) if c.is_healthy]
        while serving:
            replica = self.router.route(rid, ids, cost, serving)
            try:
                return await self.clients[replica].add_request(
                    prompt, params, rid, timeout_s, stream, priority
                )
            except (EngineStoppedError, EngineDeadError):
                # It died (or began shutting down) since `serving` was read, or before it
                # accepted the request (nothing of it was streamed): try the others.
                self.router.release(rid)
                serving.remove(replica)
            except BaseException:
                self.router.release(rid)  # refused (or cancelled): it counts no more
                raise
        raise EngineStoppedError(self._refusal())

    def _refusal(self) -> str:
        if not self.is_started:
            return "the engine is not started"
        reason = self.dead_reason
        return f"no replica is serving ({reason})" if reason else "the engine is shutting down"

    def abort(self, request_id: str) -> None:
        replica = self.router.owner(request_id)
        if replica is not None:
            self.clients[replica].abort(request_id)

    async def control(self, op: str, level: int = 1, model_path: str | None = None) -> bool:
        """A weight operation on every replica at once (EngineCoreClient.control); whether they
        sleep after it.

        The replicas must hold one model, so an operation that would be refused by some is
        refused before any replica changes: EngineBusyError while this client has requests in
        flight on any replica or another operation runs, EngineStoppedError while a replica
        does not serve (dead or restarting). Requests that arrive meanwhile wait for the
        operation's end. A refusal the checks cannot see (requests from another API server
        process, a failure on the device) comes after the others have done it: a sleep is then
        undone on them (they are woken again), and any other operation is raised with an error
        that names the replicas done and not done (the replicas then differ)."""
        if op != "is_sleeping":
            if self._control_op is not None:
                raise EngineBusyError(f"{op}: {self._control_op} is running on the replicas")
            self._control_op = op
        try:
            if op != "is_sleeping":
                self._check_all_can(op)
            results = await self._on_all(op, level, model_path)
            failed = {i: r for i, r in enumerate(results) if isinstance(r, BaseException)}
            if failed and len(failed) < len(results) and op != "is_sleeping":
                await self._partly_done(op, failed)
        finally:
            if op != "is_sleeping":
                self._control_op = None
        if failed:
            raise next(iter(failed.values()))
        return any(results)

    async def _on_all(self, op: str, level: int = 1, model_path: str | None = None, which=None):
        clients = self.clients if which is None else [self.clients[i] for i in which]
        return await asyncio.gather(
            *(c.control(op, level, model_path) for c in clients), return_exceptions=True
        )

    async def _partly_done(self, op: str, failed: dict[int, BaseException]) -> NoReturn:
        """Some replicas did `op`, the others (`failed`: replica -> its error) refused or failed.
        A sleep is undone where it was done, so the refusal means what it says; otherwise the
        error says which replicas differ now (the same update_weights again brings the others
        to it: a replica that has the weights loads them again)."""
        done = [i for i in range(len(self.clients)) if i not in failed]
        i, first = next(iter(failed.items()))
        cause = f"{op} failed on replica(s) {sorted(failed)} (replica {i}: {first})"
        if op == "sleep":
            undo = await self._on_all("wake_up", which=done)
            done = [r for r, awake in zip(done, undo, strict=True) if awake is not False]
            if not done:
                logger.warning("%s; the replicas that slept were woken again", cause)
                raise _like(
                    first, f"{cause}; the replicas that slept were woken again: none changed"
                )
        logger.error("%s; done on replica(s) %s", cause, done)
        raise _like(first, f"{cause}; done on replica(s) {done}: the replicas now differ")

    async def _wait_for_control(self, rid: str, timeout_s: float | None) -> float | None:
        """Wait while a weight operation runs (the request is served by the weights it leaves);
        the request's time left after the wait."""
        if self._control_op is None:
            return timeout_s
        loop = asyncio.get_running_loop()
        start = loop.time()
        while (op := self._control_op) is not None:
            if timeout_s is not None and loop.time() - start >= timeout_s:
                raise RequestTimeoutError(
                    f"request {rid} did not finish within {timeout_s:g} s: it waited for {op} "
                    "on the replicas"
                )
            await asyncio.sleep(CONTROL_POLL_S)
        if timeout_s is None:
            return None
        return max(timeout_s - (loop.time() - start), CONTROL_POLL_S)

    def _check_all_can(self, op: str) -> None:
        """Raise unless every replica serves and none has requests of this client in flight."""
        down = [i for i, c in enumerate(self.clients) if not c.is_healthy]
        if down:
            raise EngineStoppedError(
                f"{op}: replica(s) {down} not serving ({self.dead_reason or 'restarting'}); "
                "no replica changed"
            )
        busy = {i: c.num_in_flight for i, c in enumerate(self.clients) if c.num_in_flight}
        if busy:
            raise EngineBusyError(
                f"{op}: requests in flight on replica(s) {sorted(busy)} "
                f"({sum(busy.values())} in all); no replica changed: retry once they finish"
            )

    def wait_healthy(self, timeout_s: float) -> bool:
        """Block until every replica serves (after a restart); False on timeout."""
        deadline = time.monotonic() + timeout_s
        while not all(c.is_healthy for c in self.clients):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True


def _like(error: BaseException, message: str) -> BaseException:
    """`error`'s kind with `message` (the server maps the kind to its status), chained to it."""
    try:
        out = type(error)(message)
    except TypeError:  # a kind that takes other arguments
        out = RuntimeError(message)
    out.__cause__ = error
    return out
