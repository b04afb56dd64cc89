"""DataParallelClient's routing over fake replica clients (no processes): a replica that dies
between the health check and the add hands the request to another, and nothing stays counted;
a weight operation that some replica would refuse reaches none; a request that waits for a
weight operation does so within its own timeout."""

from __future__ import annotations

import asyncio

import pytest

from nori_jax import dp_client
from nori_jax.async_engine import EngineStoppedError, RequestTimeoutError
from nori_jax.core.replica_router import ReplicaRouter, RouterConfig
from nori_jax.dp_client import DataParallelClient
from nori_jax.engine_config import EngineConfig
from nori_jax.metrics import EngineMetrics
from nori_jax.sampling_params import SamplingParams
from nori_jax.weight_control import EngineBusyError


class FakeReplica:
    def __init__(self, dies_on_add: bool = False, refuses: Exception | None = None):
        self.healthy = True
        self.dies_on_add, self.refuses = dies_on_add, refuses
        self.added: list[str] = []
        self.num_in_flight = 0
        self.ops: list[str] = []
        self.timeouts: list[float | None] = []

    async def control(self, op, level=1, model_path=None) -> bool:
        self.ops.append(op)
        return op == "sleep"

    @property
    def is_healthy(self) -> bool:
        return self.healthy

    @property
    def dead_reason(self) -> str | None:
        return None if self.healthy else "the engine core process exited (code -9)"

    @property
    def is_started(self) -> bool:
        return True

    async def add_request(self, prompt, params, request_id, timeout_s, stream, priority=0):
        if self.dies_on_add:
            self.healthy = False
            raise EngineStoppedError("the engine is not serving (restarting)")
        if self.refuses is not None:
            raise self.refuses
        self.added.append(request_id)
        self.timeouts.append(timeout_s)
        return request_id


def client_over(*replicas: FakeReplica) -> DataParallelClient:
    c = DataParallelClient.__new__(DataParallelClient)
    c.clients = list(replicas)
    c.router = ReplicaRouter(len(replicas), RouterConfig(page_size=16))
    c.max_model_len = 256
    return c


def add(c: DataParallelClient, rid: str):
    return asyncio.run(c.add_request([1, 2, 3], SamplingParams(max_tokens=4), rid))


def test_a_replica_dying_during_the_add_passes_the_request_on() -> None:
    dying, alive = FakeReplica(dies_on_add=True), FakeReplica()
    c = client_over(dying, alive)
    assert add(c, "a") == "a" and alive.added == ["a"]
    assert c.router.owner("a") == 1 and c.router.load == [0, 7]


def test_no_replica_serving_is_a_stopped_engine_naming_why() -> None:
    c = client_over(FakeReplica(dies_on_add=True), FakeReplica(dies_on_add=True))
    with pytest.raises(EngineStoppedError, match="no replica is serving .*replica 0: .*exited"):
        add(c, "a")
    assert c.router.load == [0, 0]


def test_a_refusal_is_the_callers_and_releases_the_route() -> None:
    c = client_over(FakeReplica(refuses=ValueError("request_id='a' is already in use")))
    with pytest.raises(ValueError, match="already in use"):
        add(c, "a")
    assert c.router.load == [0] and c.router.owner("a") is None


def test_a_weight_operation_some_replica_would_refuse_reaches_none() -> None:
    idle, busy = FakeReplica(), FakeReplica()
    busy.num_in_flight = 2
    c = client_over(idle, busy)
    with pytest.raises(EngineBusyError, match=r"replica\(s\) \[1\] \(2 in all\); no replica"):
        asyncio.run(c.control("update_weights", model_path="/ckpt"))
    busy.num_in_flight, busy.healthy = 0, False
    with pytest.raises(EngineStoppedError, match=r"replica\(s\) \[1\] not serving"):
        asyncio.run(c.control("sleep"))
    assert idle.ops == busy.ops == []  # neither was asked
    assert asyncio.run(c.control("is_sleeping")) is False  # a question needs no quiet
    busy.healthy = True
    assert asyncio.run(c.control("sleep")) is True
    assert idle.ops == busy.ops == ["is_sleeping", "sleep"] and c._control_op is None


def test_a_request_waits_for_a_weight_operation_within_its_own_timeout() -> None:
    replica = FakeReplica()
    c = client_over(replica)
    c._control_op = "update_weights"  # an operation that outlasts the request's timeout

    async def too_late():
        await c.add_request([1, 2, 3], SamplingParams(max_tokens=4), "a", timeout_s=0.05)

    with pytest.raises(
        RequestTimeoutError,
        match=r"request a did not finish within 0.05 s: .*"
        "update_weights",
    ):
        asyncio.run(too_late())
    assert replica.added == [] and c.router.load == [0]

    async def after_the_operation():
        async def end_it():
            await asyncio.sleep(0.2)
            c._control_op = None

        ender = asyncio.create_task(end_it())
        rid = await c.add_request([1, 2, 3], SamplingParams(max_tokens=4), "b", timeout_s=5.0)
        await ender
        return rid

    assert asyncio.run(after_the_operation()) == "b"
    # the replica gets the time the request has left after its wait
    # (at least the 0.2 s it waited is gone; the lower bound only leaves room for a slow host)
    assert replica.added == ["b"] and 2.0 < replica.timeouts[0] <= 4.81


@pytest.mark.parametrize("timeout_s", [0, -1.5])
def test_a_timeout_that_is_not_positive_is_refused_before_any_wait(timeout_s) -> None:
    replica = FakeReplica()
    c = client_over(replica)
    c._control_op = "update_weights"  # would wait forever if the check came after the wait

    async def add():
        await c.add_request([1, 2, 3], SamplingParams(max_tokens=4), "a", timeout_s=timeout_s)

    with pytest.raises(ValueError, match=rf"timeout_s={timeout_s} must be > 0"):
        asyncio.run(asyncio.wait_for(add(), 5))
    assert replica.added == []


@pytest.mark.parametrize("bound, second", [(0, 1), (1_000_000, 0)])
def test_the_meshs_prefix_affinity_bound_reaches_the_router(monkeypatch, bound, second) -> None:
    """At 0, a request whose prefix replica 0 holds goes to the idle replica 1 once 0 is busier;
    with a large bound it stays where its pages are cached."""

    def core_client(config, replica, on_request_done, **options) -> FakeReplica:
        r = FakeReplica()
        r.tokenizer, r.max_model_len, r.metrics = None, 256, EngineMetrics()
        return r

    monkeypatch.setattr(dp_client, "EngineCoreClient", core_client)
    mesh = {"data": 2, "prefix_affinity_max_imbalance_tokens": bound}
    c = DataParallelClient(
        EngineConfig.from_dict({"load_format": "dummy", "page_size": 16, "mesh": mesh})
    )
    assert c.router.config.max_imbalance_tokens == bound
    shared = list(range(1, 2 * 16 + 1))  # two full pages
    for rid, tail in (("a", 100), ("b", 200)):
        asyncio.run(c.add_request(shared + [tail], SamplingParams(max_tokens=4), rid))
    assert [c.router.owner("a"), c.router.owner("b")] == [0, second]


class RefusingReplica(FakeReplica):
    """Refuses weight operations with `error` (what another API server's requests, unseen by
    this client's checks, make a replica answer)."""

    def __init__(self, error: Exception):
        super().__init__()
        self.error = error

    async def control(self, op, level=1, model_path=None) -> bool:
        self.ops.append(op)
        raise self.error


def test_a_sleep_one_replica_refuses_is_undone_on_the_others() -> None:
    idle = FakeReplica()
    busy = RefusingReplica(EngineBusyError("sleep: 3 requests in flight"))
    c = client_over(idle, busy)
    with pytest.raises(EngineBusyError, match=r"replica\(s\) \[1\].*woken again: none changed"):
        asyncio.run(c.control("sleep"))
    assert idle.ops == ["sleep", "wake_up"] and c._control_op is None


def test_an_update_one_replica_refuses_names_the_replicas_that_differ() -> None:
    idle, busy = FakeReplica(), RefusingReplica(EngineBusyError("3 requests in flight"))
    c = client_over(busy, idle)
    with pytest.raises(EngineBusyError, match=r"done on replica\(s\) \[1\]: the replicas now"):
        asyncio.run(c.control("update_weights", model_path="/ckpt"))
    assert idle.ops == ["update_weights"] and c._control_op is None
