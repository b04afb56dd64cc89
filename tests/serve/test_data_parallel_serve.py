"""The server over two data-parallel replicas, one engine-core process each (what
`nori-jax serve --data-parallel-size 2` runs): the same greedy tokens from either replica,
routing by prefix and load, /metrics labelled by replica, and killing one replica's process
fails only that replica's requests while the other serves on; the dead one restarts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import threading
import time

import httpx
import pytest
from serve_harness import Server, client, engine_config, running_server

from nori_jax import SamplingParams
from nori_jax.core_client import EngineCoreClient
from nori_jax.dp_client import DataParallelClient
from nori_jax.mesh_config import MeshConfig
from nori_jax.weight_control import EngineBusyError

PROMPTS = [[5, 6, 7], [40, 41, 42, 43, 44, 45], list(range(100, 160)), [9, 8, 7, 6] * 5]
GREEDY = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server():
    config = dataclasses.replace(engine_config(), mesh=MeshConfig(data=2))
    settings = {"enable_weight_control": True}  # /sleep and the others, for the last test
    with running_server(settings, engine=DataParallelClient(config)) as s:
        yield s


_EXPECTED: list[list[int]] = []


def _expected_tokens(server: Server) -> list[list[int]]:
    """PROMPTS' greedy tokens from each replica's own client, straight (no routing): both must
    agree (the single engine's tokens: tests/test_data_parallel.py, test_engine_process.py)."""
    if not _EXPECTED:
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

        async def on(replica: EngineCoreClient) -> list[list[int]]:
            streams = [await replica.add_request(p, params, stream=False) for p in PROMPTS]
            return [(await s.result()).token_ids for s in streams]

        each = [asyncio.run(on(c)) for c in server.engine.clients]
        assert each[0] == each[1]
        _EXPECTED.extend(each[0])
    return _EXPECTED


def _generate_all(server: Server, prompts: list[list[int]]) -> list[list[int]]:
    """Every prompt at once (so they are in flight together and spread over the replicas)."""
    got: dict[int, list[int]] = {}

    def one(i: int) -> None:
        with client(server) as c:
            got[i] = c.post("/generate", json={"prompt": prompts[i], **GREEDY}).json()["token_ids"]

    jobs = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in jobs:
        t.start()
    for t in jobs:
        t.join(60)
    return [got[i] for i in range(len(prompts))]


def _generation_tokens(server: Server) -> list[float]:
    return [r["nori:generation_tokens_total"] for r in server.engine.get_metrics()["replicas"]]


def test_both_replicas_serve_the_same_tokens(server: Server) -> None:
    expected = _expected_tokens(server)
    before = _generation_tokens(server)
    assert _generate_all(server, PROMPTS) == expected
    after = _generation_tokens(server)
    assert all(a > b for a, b in zip(after, before, strict=True))  # both replicas took some
    text = httpx.get(f"{server.url}/metrics").text
    for replica in ("0", "1"):
        assert f'nori:recompiles_total{{replica="{replica}"}} 0.0' in text
    assert text.count('nori:model_config_info{dtype="float32"') == 2
    assert server.engine.router.load == [0, 0]


def test_unseeded_choices_split_over_the_replicas_sample_apart(server: Server) -> None:
    """A short prompt's choices are balanced over the replicas (no page to share), and each
    replica's client drew its unseeded requests' seeds from a generator seeded alike: both
    choices of an n=2 request came out the same, every time."""
    with client(server) as c:
        for _ in range(3):
            r = c.post(
                "/v1/completions",
                json={
                    "prompt": [5, 6, 7],
                    "n": 2,
                    "max_tokens": 16,
                    "temperature": 1.0,
                    "ignore_eos": True,
                    "logprobs": 0,
                },
            )
            assert r.status_code == 200, r.text
            first, second = (ch["logprobs"]["tokens"] for ch in r.json()["choices"])
            assert first != second


def test_a_shared_prefix_goes_to_one_replica(server: Server) -> None:
    system = list(range(1, 33))  # two full pages of the tiny preset's page size 16
    with client(server) as c:
        c.post("/generate", json={"prompt": system + [50], **GREEDY})
    before = _generation_tokens(server)
    _generate_all(server, [system + [60 + i] for i in range(4)])
    gained = [a - b for a, b in zip(_generation_tokens(server), before, strict=True)]
    assert sorted(gained) == [0, 4 * GREEDY["max_tokens"]]
    # A request a replica refuses is the client's error, and counts on no replica's load.
    with client(server) as c:
        r = c.post("/generate", json={"prompt": system + [10**6], **GREEDY})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert server.engine.router.load == [0, 0]


def test_killing_one_replica_fails_only_its_requests(server: Server) -> None:
    engine: DataParallelClient = server.engine
    # As long as the preset's 256-token context allows (10 prompt tokens), and the four sent at
    # one instant (a barrier after each client is made): a request that started late on a loaded
    # CI machine could otherwise see a neighbour finish before the replicas are counted.
    body = {"max_tokens": 240, "ignore_eos": True, "temperature": 0.0, "stream": True}
    results: dict[int, tuple[int, list[str]]] = {}
    started = [threading.Event() for _ in range(4)]
    together = threading.Barrier(4)

    def streamed(i: int) -> None:
        prompt = list(range(10 + 20 * i, 20 + 20 * i))  # distinct: 2 per replica by load
        with client(server) as c:
            together.wait(30)
            with c.stream("POST", "/v1/completions", json=body | {"prompt": prompt}) as r:
                lines = []
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                        started[i].set()
                results[i] = (r.status_code, lines)

    jobs = [threading.Thread(target=streamed, args=(i,)) for i in range(4)]
    for t in jobs:
        t.start()
    deadline = time.monotonic() + 30
    while not all(e.is_set() for e in started):
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert [c.num_in_flight for c in engine.clients] == [2, 2]
    killed = engine.pids[1]
    os.kill(killed, signal.SIGKILL)
    # While replica 1 is down, the server stays up and new requests go to replica 0.
    deadline = time.monotonic() + 30
    while engine.clients[1].is_healthy:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    health = httpx.get(f"{server.url}/health")  # serving, and saying which replica is down
    assert health.status_code == 200 and "replica 1" in health.json()["degraded"], health.text
    with client(server) as c:
        r = c.post("/generate", json={"prompt": [1, 2, 3], **GREEDY})
    assert r.status_code == 200 and len(r.json()["token_ids"]) == GREEDY["max_tokens"]
    for t in jobs:
        t.join(60)
        assert not t.is_alive()
    outcomes = []
    for i in range(4):
        status, lines = results[i]
        assert status == 200 and lines[-1] == "data: [DONE]"
        last = json.loads(lines[-2][len("data: ") :])
        if "error" in last:
            outcomes.append(last["error"]["code"])
        else:
            assert last["choices"][0]["finish_reason"] == "length"
            outcomes.append("length")
    assert sorted(outcomes) == ["engine_dead", "engine_dead", "length", "length"]
    # The dead replica restarts; both serve again, the restart counted under its label.
    assert engine.wait_healthy(120), engine.dead_reason
    assert engine.pids[1] != killed and engine.pids[0] != killed
    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'nori:engine_restarts_total{replica="1"} 1.0' in metrics
    assert 'nori:engine_restarts_total{replica="0"} 0.0' in metrics
    assert engine.router.load == [0, 0] and engine.num_in_flight == 0
    assert _generate_all(server, PROMPTS) == _expected_tokens(server)


def test_a_request_a_dying_replica_never_accepted_goes_to_another(server: Server) -> None:
    """Replica 1 stopped (SIGSTOP), then killed while a request routed to it waits for its
    acceptance: nothing of that request was streamed, so it is served by replica 0 (it failed
    with a 500 engine_dead while replica 0 served)."""
    engine: DataParallelClient = server.engine
    stopped = engine.pids[1]
    os.kill(stopped, signal.SIGSTOP)
    results: dict[str, httpx.Response] = {}

    def one(name: str, max_tokens: int) -> None:
        with client(server) as c:
            body = {"prompt": [1, 2, 3], **GREEDY, "max_tokens": max_tokens}
            results[name] = c.post("/generate", json=body)

    def wait_in_flight(replica: int) -> None:
        deadline = time.monotonic() + 30
        while engine.clients[replica].num_in_flight == 0:
            assert time.monotonic() < deadline
            time.sleep(0.005)

    long = threading.Thread(target=one, args=("long", 200))  # ties go to replica 0
    short = threading.Thread(target=one, args=("short", GREEDY["max_tokens"]))
    try:
        long.start()
        wait_in_flight(0)
        short.start()  # by load, to the stopped replica 1: it waits for an acceptance
        wait_in_flight(1)
    finally:
        os.kill(stopped, signal.SIGKILL)
    for t, name, length in ((long, "long", 200), (short, "short", GREEDY["max_tokens"])):
        t.join(60)
        assert not t.is_alive()
        assert results[name].status_code == 200, results[name].text
        assert len(results[name].json()["token_ids"]) == length
    assert engine.wait_healthy(120), engine.dead_reason
    assert engine.router.load == [0, 0]


def test_sleep_and_wake_up_reach_every_replica(server: Server) -> None:
    """A weight operation through the data-parallel client runs on both replicas: both sleep
    (each refuses requests), both wake with their tokens unchanged."""
    expected = _expected_tokens(server)
    engine: DataParallelClient = server.engine
    assert asyncio.run(engine.control("sleep", 1)) is True
    assert [asyncio.run(c.control("is_sleeping")) for c in engine.clients] == [True, True]
    with client(server) as c:
        r = c.post("/generate", json={"prompt": PROMPTS[0], **GREEDY})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_asleep", r.text
    assert asyncio.run(engine.control("wake_up")) is False
    assert [asyncio.run(c.control("is_sleeping")) for c in engine.clients] == [False, False]
    assert _generate_all(server, PROMPTS) == expected


def test_a_weight_operation_changes_no_replica_while_one_is_busy(server: Server) -> None:
    """One replica serving a request: sleep is refused before any replica changes (before, the
    idle replica slept and the busy one refused, leaving the two apart), over HTTP as 409. A
    request sent while an operation runs waits for its end, then is served."""
    engine: DataParallelClient = server.engine
    long = SamplingParams(max_tokens=240, temperature=0.0, ignore_eos=True)
    ended: list[str | None] = []

    def busy() -> None:  # one request, on one replica, until aborted below
        async def run() -> None:
            stream = await engine.add_request([3, 4, 5], long, "busy-1", stream=False)
            ended.append((await stream.result()).finish_reason)

        asyncio.run(run())

    job = threading.Thread(target=busy)
    job.start()
    deadline = time.monotonic() + 30
    while engine.num_in_flight != 1:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert sorted(c.num_in_flight for c in engine.clients) == [0, 1]
    with pytest.raises(EngineBusyError, match=r"in flight on replica\(s\) \[\d\]"):
        asyncio.run(engine.control("sleep", 1))
    assert [asyncio.run(c.control("is_sleeping")) for c in engine.clients] == [False, False]
    with client(server) as c:
        r = c.post("/sleep", params={"level": 1})
    assert r.status_code == 409 and "no replica changed" in r.text, r.text
    assert [asyncio.run(c.control("is_sleeping")) for c in engine.clients] == [False, False]
    engine.abort("busy-1")
    job.join(60)
    assert ended == ["abort"] and engine.num_in_flight == 0

    # a request sent while an operation runs waits for it, then is served by both's weights
    async def sleep_wake_with_a_request_between() -> list[int]:
        op = asyncio.create_task(engine.control("sleep", 1))
        await asyncio.sleep(0)  # the operation has begun: it holds the replicas
        assert engine._control_op == "sleep"
        request = asyncio.create_task(engine.add_request([5, 6, 7], SamplingParams(**GREEDY)))
        await op
        await engine.control("wake_up")
        return (await (await request).result()).token_ids

    assert asyncio.run(sleep_wake_with_a_request_between()) == _expected_tokens(server)[0]
