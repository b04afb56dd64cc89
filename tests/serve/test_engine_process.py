"""The server over the engine core in its own process (what `nori-jax serve` runs).

Same greedy tokens as the in-process engine; outputs streamed across the process boundary; a
request the core cannot take is refused alone; and when the engine-core process dies, every
request in flight ends with a JSON error, /health turns 503, and the client starts a new core
process and serves again (the restart counted in /metrics).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import signal
import threading
import time

import httpx
import msgspec
import numpy as np
import pytest
from openai import OpenAI
from serve_harness import MODEL_NAME, Server, client, engine_config, running_server

from nori_jax import LLM, SamplingParams
from nori_jax.async_engine import EngineStoppedError
from nori_jax.core_client import EngineCoreClient
from nori_jax.engine_core_process import AddRequests

PROMPTS = [[5, 6, 7], [40, 41, 42, 43, 44, 45], list(range(100, 160))]
GREEDY = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server():
    with running_server(engine=EngineCoreClient(engine_config())) as s:
        yield s


_EXPECTED: list[list[int]] = []
_TOP: list[list[list[tuple[int, float]]]] = []  # PROMPTS[2] greedy with logprobs=3, in-process
_FORCED = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logit_bias={77: 100.0})
_FORCED_TEXT: list[str] = []  # PROMPTS[1] with _FORCED, in-process
# Penalties and min_tokens, as the OpenAI routes take them (extra_body: vLLM's extensions).
_PENALIZED = [
    dict(presence_penalty=1.5, frequency_penalty=0.5),
    dict(extra_body={"repetition_penalty": 1.6}),
    dict(seed=9, temperature=0.8, frequency_penalty=-0.5, extra_body={"repetition_penalty": 0.9}),
]
_PROMPT_LOGPROBS: list[list[float | None]] = []  # PROMPTS[2]'s, in-process
_PENALIZED_TEXT: list[str] = []  # PROMPTS[0] (greedy repeats itself) with each, in-process


def _expected_tokens() -> list[list[int]]:
    if not _EXPECTED:
        llm = LLM.from_config(engine_config())
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        _EXPECTED.extend(o.token_ids for o in llm.generate(PROMPTS, params))
        top = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=3)
        _TOP.append(llm.generate([PROMPTS[2]], top)[0].top_logprobs)
        forced = llm.generate([PROMPTS[1]], _FORCED)[0]
        assert forced.token_ids == [77, 77, 77]
        _FORCED_TEXT.append(forced.text)
        asking = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
        _PROMPT_LOGPROBS.append(llm.generate([PROMPTS[2]], asking)[0].prompt_logprobs)
        for kw in _PENALIZED:
            kw = {**kw, **kw.get("extra_body", {})}
            kw.pop("extra_body", None)
            params = SamplingParams(**{"max_tokens": 12, "temperature": 0.0, **kw})
            _PENALIZED_TEXT.append(llm.generate([PROMPTS[0]], params)[0].text)
    return _EXPECTED


def test_greedy_tokens_match_the_in_process_engine(server: Server) -> None:
    expected = _expected_tokens()
    with client(server) as c:
        got = [
            c.post("/generate", json={"prompt": p, **GREEDY}).json()["token_ids"] for p in PROMPTS
        ]
    assert got == expected


def test_min_p_and_logit_bias_cross_the_process_boundary(server: Server) -> None:
    """SamplingParams' min_p and logit_bias (a dict with int keys) travel to the core process
    (msgpack) and act there as in-process: min_p = 1 is greedy, +100 forces its token."""
    expected = _expected_tokens()
    body = {"prompt": PROMPTS[0], **GREEDY, "temperature": 2.0, "seed": 3, "min_p": 1.0}
    oa = OpenAI(base_url=f"{server.url}/v1", api_key="none")
    with client(server) as c:
        assert c.post("/generate", json=body).json()["token_ids"] == expected[0]
    forced = oa.completions.create(
        model=MODEL_NAME,
        prompt=PROMPTS[1],
        max_tokens=3,
        temperature=0.0,
        logit_bias={"77": 100},
        extra_body={"ignore_eos": True},
    )
    assert forced.choices[0].text == _FORCED_TEXT[0]
    # top logprobs come back through msgpack: the in-process engine's pairs
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=3)

    async def top() -> list[list[tuple[int, float]]]:
        stream = await server.engine.add_request(PROMPTS[2], params, stream=False)
        return [o async for o in stream][-1].top_logprobs

    got, want = asyncio.run(top()), _TOP[0]
    assert [[t for t, _ in p] for p in got] == [[t for t, _ in p] for p in want]
    np.testing.assert_allclose([[v for _, v in p] for p in got], [[v for _, v in p] for p in want])


def test_penalties_and_min_tokens_cross_the_process_boundary(server: Server) -> None:
    """presence / frequency (OpenAI's fields), repetition_penalty and min_tokens (vLLM's) reach
    the core process and act there as in-process; min_tokens holds a stop string back."""
    _expected_tokens()
    oa = OpenAI(base_url=f"{server.url}/v1", api_key="none")
    plain = oa.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=12, temperature=0.0
    ).choices[0]
    for kw, want in zip(_PENALIZED, _PENALIZED_TEXT, strict=True):
        got = oa.completions.create(
            model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=12, **{"temperature": 0.0, **kw}
        ).choices[0]
        assert got.text == want, kw
    assert _PENALIZED_TEXT[0] != plain.text and _PENALIZED_TEXT[1] != plain.text
    # A stop string in the first tokens: cut there, or, with min_tokens past it, not matched.
    stop = plain.text[1:3]
    cut = oa.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=12, temperature=0.0, stop=stop
    ).choices[0]
    assert cut.text == plain.text[: plain.text.index(stop)] and cut.finish_reason == "stop"
    held = oa.completions.create(
        model=MODEL_NAME,
        prompt=PROMPTS[0],
        max_tokens=12,
        temperature=0.0,
        stop=stop,
        extra_body={"min_tokens": 12},
    ).choices[0]
    assert held.text == plain.text and held.finish_reason == plain.finish_reason


def test_echo_with_logprobs_scores_the_prompt_across_the_process_boundary(
    server: Server,
) -> None:
    """Completions' echo with logprobs (lm-evaluation-harness's loglikelihood): the prompt's
    tokens lead `logprobs`, each with its logprob (the first's null) and top 2, equal to the
    in-process engine's prompt_logprobs; streamed, the prompt's chunk carries them."""
    _expected_tokens()
    oa = OpenAI(base_url=f"{server.url}/v1", api_key="none")
    kw = dict(model=MODEL_NAME, prompt=PROMPTS[2], max_tokens=3, temperature=0.0, logprobs=2)
    whole = oa.completions.create(echo=True, extra_body={"ignore_eos": True}, **kw).choices[0]
    lp, n = whole.logprobs, len(PROMPTS[2])
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    np.testing.assert_allclose(lp.token_logprobs[1:n], _PROMPT_LOGPROBS[0][1:], atol=1e-5)
    prompt_part = zip(lp.tokens[1:n], lp.token_logprobs[1:n], lp.top_logprobs[1:n], strict=True)
    for token, value, top in prompt_part:
        assert top[token] == value and 1 <= len(top) <= 3
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    plain = oa.completions.create(extra_body={"ignore_eos": True}, **kw).choices[0]
    # The same tokens; their logprobs to float32 rounding: the plain request may find the
    # prompt's pages in the prefix cache (earlier tests sent PROMPTS[2]) and attend over them
    # in another order than the echo request's whole prefill, which can move the last bit.
    assert plain.logprobs.tokens == lp.tokens[n:]
    np.testing.assert_allclose(lp.token_logprobs[n:], plain.logprobs.token_logprobs, atol=1e-5)
    assert whole.text.endswith(plain.text)
    chunks = list(
        oa.completions.create(echo=True, stream=True, extra_body={"ignore_eos": True}, **kw)
    )
    first = chunks[0].choices[0]
    assert first.logprobs.token_logprobs[0] is None and len(first.logprobs.tokens) == n
    np.testing.assert_allclose(
        first.logprobs.token_logprobs[1:], _PROMPT_LOGPROBS[0][1:], atol=1e-5
    )
    assert "".join(c.choices[0].text for c in chunks) == whole.text


def test_vllms_prompt_logprobs_field_on_both_routes(server: Server) -> None:
    """vLLM's `prompt_logprobs` extension: per prompt token (null first) its id's logprob, rank
    and text, then its position's k likeliest with ranks 1 to k; the choice's on completions, the
    answer's on chat; not with stream."""
    _expected_tokens()
    oa = OpenAI(base_url=f"{server.url}/v1", api_key="none")
    answer = oa.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[2], max_tokens=2, extra_body={"prompt_logprobs": 2}
    )
    entries = answer.choices[0].model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(PROMPTS[2])
    for p, entry in enumerate(entries[1:], start=1):
        own = entry[str(PROMPTS[2][p])]
        assert own["logprob"] == pytest.approx(_PROMPT_LOGPROBS[0][p], abs=1e-5)
        others = [e for e in entry.values() if e is not own]
        assert sorted(e["rank"] for e in others) == [r for r in (1, 2) if r != own["rank"]]
        assert len(entry) == (2 if own["rank"] <= 2 else 3)
        assert all(e["logprob"] >= own["logprob"] - 1e-6 for e in others if e["rank"] < own["rank"])
    chat = oa.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        extra_body={"prompt_logprobs": 0},
    )
    chat_entries = chat.model_extra["prompt_logprobs"]
    assert chat_entries[0] is None and all(len(e) == 1 for e in chat_entries[1:])
    with client(server) as c:
        streamed = {"prompt": [5, 6], "max_tokens": 2, "stream": True, "prompt_logprobs": 1}
        r = c.post("/v1/completions", json=streamed)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


def test_lm_evaluation_harness_loglikelihood_request(server: Server) -> None:
    """The body lm-evaluation-harness's local-completions sends for a loglikelihood (context and
    continuation as one batch of token ids, echo, logprobs 1, max_tokens 1), read as it reads it:
    the continuation's summed logprobs and whether each of its tokens is the greedy one."""
    _expected_tokens()
    ids, ctxlen = PROMPTS[2], 40
    body = {
        "model": MODEL_NAME,
        "prompt": [ids],
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }
    with client(server) as c:
        r = c.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    values = choice["logprobs"]["token_logprobs"][ctxlen:-1]
    tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
    assert len(values) == len(ids) - ctxlen
    np.testing.assert_allclose(sum(values), sum(_PROMPT_LOGPROBS[0][ctxlen:]), rtol=1e-5)
    is_greedy = all(v == max(top.values()) for v, top in zip(values, tops, strict=True))
    assert isinstance(is_greedy, bool) and all(1 <= len(top) <= 2 for top in tops)


def test_a_priority_the_core_would_ignore_is_refused_by_name(server: Server) -> None:
    """The core process runs FCFS: a priority other than 0 comes back as a 400 naming it."""
    with client(server) as c:
        r = c.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2, "priority": 3})
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority", r.text
        ok = c.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2, "priority": 0})
        assert ok.status_code == 200


def test_streams_through_the_openai_client(server: Server) -> None:
    oa = OpenAI(base_url=f"{server.url}/v1", api_key="none")
    chunks = list(
        oa.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=10,
            temperature=0,
            stream=True,
        )
    )
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    whole = oa.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=10, temperature=0
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == whole.choices[0].message.content
    metrics = httpx.get(f"{server.url}/metrics").text
    assert "nori:generation_tokens_total" in metrics and "nori:recompiles_total 0.0" in metrics
    # the core process's own work around its steps: its socket, the outputs it sends
    io_s = next(line for line in metrics.splitlines() if line.startswith("nori:engine_core_io"))
    assert float(io_s.split()[-1]) > 0
    # the launches by shape, counted in the core and carried by each step's stats
    shapes = [line for line in metrics.splitlines() if line.startswith("nori:step_launches_total")]
    assert shapes and sum(float(line.split()[-1]) for line in shapes) >= 10
    assert any('kind="decode"' in line for line in shapes)
    info = next(line for line in metrics.splitlines() if line.startswith("nori:model_config_info"))
    for label in (
        'dtype="float32"',
        'kv_cache_dtype="float32"',
        'quantization="none"',
        'gpu_client="none"',  # a CPU engine
    ):
        assert label in info  # from the core


def test_the_core_process_refuses_a_bad_request_alone(server: Server) -> None:
    """Requests that skipped every client-side check (sent as raw bytes) are refused by the core
    one by one, with the field at fault, and the core process lives on."""
    engine: EngineCoreClient = server.engine
    pid = engine.pid
    enc = msgspec.msgpack.Encoder().encode
    docs = {  # EngineCoreRequest's fields: id, prompt ids, params, seed, eos ids, arrival time
        "bad-max": (["bad-max", [1, 2], {"max_tokens": 0}, 0, [2], 0.0], "max_tokens"),
        "bad-ids": (["bad-ids", [1, 10**6], {"max_tokens": 4}, 0, [2], 0.0], "prompt"),
        "bad-seed": (["bad-seed", [1, 2], {"max_tokens": 4}, 2**40, [2], 0.0], "seed"),
        "bad-shape": (["bad-shape", "not a list of ids"], None),
    }
    futures = {rid: concurrent.futures.Future() for rid in docs}
    engine._acks.update(futures)
    raws = [msgspec.Raw(enc(doc)) for doc, _ in docs.values()]
    engine._send_bytes(enc(AddRequests(raws)))  # one message: each request refused alone
    for rid, (_, param) in docs.items():
        with pytest.raises(ValueError) as e:
            futures[rid].result(timeout=30)
        assert getattr(e.value, "param", None) == param, (rid, e.value)
    assert engine.pid == pid and engine.is_healthy
    with client(server) as c:
        assert c.post("/generate", json={"prompt": [5, 6], **GREEDY}).status_code == 200


def test_a_burst_sent_while_the_core_reads_nothing_is_served_whole(server: Server) -> None:
    """While the core runs a long step it reads no requests; a burst bigger than ZeroMQ's default
    high-water mark (1,000 messages) must queue, not be dropped (each dropped request used to
    hang until its client gave up). The core is stopped (SIGSTOP) while 2,500 requests are
    sent, then resumed: every one finishes."""
    engine: EngineCoreClient = server.engine
    pid, count = engine.pid, 2500
    params = SamplingParams(max_tokens=1, temperature=0.0)

    async def one(i: int) -> int:
        stream = await engine.add_request([5, 6, 7 + i % 50], params, stream=False)
        return len([o async for o in stream][-1].token_ids)

    async def burst() -> list[int]:
        tasks = [asyncio.create_task(one(i)) for i in range(count)]
        deadline = time.monotonic() + 60
        while engine.num_in_flight < count:  # all sent (or, before the fix, some dropped)
            assert time.monotonic() < deadline, engine.num_in_flight
            await asyncio.sleep(0.05)
        os.kill(pid, signal.SIGCONT)
        return await asyncio.wait_for(asyncio.gather(*tasks), 120)

    os.kill(pid, signal.SIGSTOP)
    try:
        lengths = asyncio.run(burst())
    finally:
        os.kill(pid, signal.SIGCONT)
    assert lengths == [1] * count
    assert engine.num_in_flight == 0 and engine.pid == pid


def test_a_request_that_cannot_be_sent_is_refused_not_left_waiting(
    server: Server, monkeypatch
) -> None:
    """A send the socket refuses (closed mid-restart) fails the request at once with
    EngineStoppedError (HTTP 503) and leaves nothing registered, instead of waiting forever for
    an acknowledgement that cannot come."""
    engine: EngineCoreClient = server.engine
    monkeypatch.setattr(engine, "_send_bytes", lambda data: "Socket operation on non-socket")
    params = SamplingParams(max_tokens=1)
    with pytest.raises(EngineStoppedError, match="could not reach the engine core"):
        asyncio.run(asyncio.wait_for(engine.add_request([5, 6], params), 10))
    assert engine.num_in_flight == 0 and not engine._acks


def _metric(server: Server, name: str) -> float:
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not exported")


def test_engine_process_death_fails_every_request_in_flight(server: Server) -> None:
    body = {"prompt": "doomed", "max_tokens": 240, "ignore_eos": True}
    results: dict[str, object] = {}

    def whole(name: str) -> None:
        with client(server) as c:
            results[name] = c.post("/v1/completions", json=body)

    started = [threading.Event() for _ in range(2)]

    def streamed(name: str, first_chunk: threading.Event) -> None:
        with client(server) as c:
            with c.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
                lines = []
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                        first_chunk.set()
                results[name] = (r.status_code, lines)

    jobs = [threading.Thread(target=whole, args=(f"whole{i}",)) for i in range(2)]
    jobs += [threading.Thread(target=streamed, args=(f"stream{i}", started[i])) for i in range(2)]
    for t in jobs:
        t.start()
    deadline = time.monotonic() + 30
    while server.engine.num_in_flight < len(jobs) or not all(e.is_set() for e in started):
        assert time.monotonic() < deadline
        time.sleep(0.005)
    errors_before = _metric(server, 'nori:request_success_total{finished_reason="error"}')
    killed = server.engine.pid
    os.kill(killed, signal.SIGKILL)
    os.waitid(os.P_PID, killed, os.WEXITED | os.WNOWAIT)  # dead, not yet reaped by its client
    # At once, before the client's reader has taken the death in: 503 with the cause (it said
    # "shutting down" in that window)
    health = httpx.get(f"{server.url}/health")
    assert health.status_code == 503 and "exited" in health.json()["reason"], health.text
    for t in jobs:
        t.join(30)
        assert not t.is_alive()
    for i in range(2):
        r = results[f"whole{i}"]
        assert r.status_code == 500 and r.json()["error"]["code"] == "engine_dead"
        status, lines = results[f"stream{i}"]
        assert status == 200 and lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][len("data: ") :])["error"]["code"] == "engine_dead"
    health = httpx.get(f"{server.url}/health")
    assert health.status_code == 503 and "exited" in health.json()["reason"]
    # The dead core's requests are counted as errors, and its batch is gone from the gauges.
    assert _metric(server, 'nori:request_success_total{finished_reason="error"}') == (
        errors_before + len(jobs)
    )
    assert _metric(server, "nori:num_requests_running") == 0
    assert _metric(server, "nori:kv_cache_usage_perc") == 0
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "after", "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
    assert "retry-after" in r.headers
    assert server.engine.num_in_flight == 0

    # Recovery: a new core process, the same answers, the restart counted.
    deadline = time.monotonic() + 120
    while httpx.get(f"{server.url}/health").status_code != 200:
        assert time.monotonic() < deadline, "the engine core was not restarted"
        time.sleep(0.1)
    assert server.engine.pid != killed
    with client(server) as c:
        got = [
            c.post("/generate", json={"prompt": p, **GREEDY}).json()["token_ids"] for p in PROMPTS
        ]
    assert got == _expected_tokens()
    metrics = httpx.get(f"{server.url}/metrics").text
    assert "nori:engine_restarts_total 1.0" in metrics
    recovery = server.engine.get_metrics()["nori:engine_recovery_seconds"]
    assert recovery == server.engine.last_recovery_s > 0


def test_a_hung_engine_core_is_killed_and_restarted(server: Server, monkeypatch) -> None:
    """A core that sends nothing while requests are in flight (here stopped with SIGSTOP; on a
    GPU, a device that never returns) is taken for hung after `hang_timeout_s`: killed, its
    requests fail with a JSON error instead of waiting for ever, /health says why, and a new
    core serves."""
    engine: EngineCoreClient = server.engine
    monkeypatch.setattr(engine, "hang_timeout_s", 2.0)
    body = {"prompt": "stuck", "max_tokens": 240, "ignore_eos": True, "stream": True}
    lines: list[str] = []
    first = threading.Event()

    def streamed() -> None:
        with client(server) as c, c.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    first.set()

    job = threading.Thread(target=streamed)
    job.start()
    assert first.wait(30)
    hung = engine.pid
    os.kill(hung, signal.SIGSTOP)
    try:
        job.join(30)
        assert not job.is_alive(), "the stream waited on a hung core"
    finally:
        try:
            os.kill(hung, signal.SIGCONT)
        except ProcessLookupError:
            pass  # killed, as it should be
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2][len("data: ") :])["error"]
    assert error["code"] == "engine_dead" and "taken for hung" in error["message"]
    health = httpx.get(f"{server.url}/health")  # (the new core takes seconds to start)
    assert health.status_code == 503 and "hung" in health.json()["reason"]
    deadline = time.monotonic() + 120
    while httpx.get(f"{server.url}/health").status_code != 200:
        assert time.monotonic() < deadline, "the engine core was not restarted"
        time.sleep(0.1)
    assert engine.pid != hung
    with client(server) as c:
        r = c.post("/generate", json={"prompt": [5, 6], **GREEDY})
        assert r.status_code == 200
