"""`Choices`, the n streams of one request read as one, over real RequestStreams fed by hand (no
engine behind them)."""

from __future__ import annotations

import asyncio

import pytest

from nori_jax.async_engine import RequestStream
from nori_jax.core.outputs import RequestOutput
from nori_jax.sampling_params import INT32_MAX, SamplingParams, sample_choices
from serve.choices import Choices, choice_request_ids


class FakeEngine:
    """What a RequestStream asks of its engine: abort(request_id)."""

    def __init__(self):
        self.aborted: list[str] = []

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def _streams(engine: FakeEngine, *scripts: list) -> list[RequestStream]:
    """Real RequestStreams holding each script's items (outputs, or an exception to raise), as
    the engine thread would have delivered them; a script without a finished output leaves its
    stream waiting, as a request still generating does. Call inside a running event loop."""
    streams = []
    for i, script in enumerate(scripts):
        stream = RequestStream(f"r-{i}", engine, deadline=None)
        for item in script:
            stream._put(item)
        streams.append(stream)
    return streams


def Out(text: str, finished: bool = False) -> RequestOutput:  # noqa: N802 - reads as a value
    return RequestOutput("r", None, [], [], text, None, finished, "length" if finished else None)


def test_outputs_are_tagged_with_their_choice_and_every_stream_is_read_to_its_end():
    async def go():
        streams = _streams(
            FakeEngine(),
            [Out("a", True)],
            [Out("c", True)],
            [Out("d", True)],
        )
        return [(i, out.new_text) async for i, out in Choices(streams).outputs()]

    assert sorted(asyncio.run(go())) == [(0, "a"), (1, "c"), (2, "d")]


def test_a_failing_choice_fails_the_request_and_aborts_the_others():
    engine = FakeEngine()

    async def go():
        streams = _streams(engine, [Out("a")], [RuntimeError("engine died")], [])
        with pytest.raises(RuntimeError, match="engine died"):
            async for _ in Choices(streams).outputs():
                pass
        await asyncio.sleep(0)
        return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    assert asyncio.run(go()) == []  # no read of a still-running choice is left waiting
    assert sorted(engine.aborted) == ["r-0", "r-2"]  # the failed one ended by itself


def test_result_fails_with_a_choice_and_leaves_no_wait_behind():
    engine = FakeEngine()

    async def go():
        streams = _streams(engine, [Out("a")], [Out("b"), ValueError("bad")])
        with pytest.raises(ValueError, match="bad"):
            await Choices(streams).result()
        await asyncio.sleep(0)
        return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    assert asyncio.run(go()) == []  # the still-running choice's wait was cancelled
    assert engine.aborted == ["r-0"]


def test_result_gives_every_final_output_in_index_order():
    async def go():
        streams = _streams(FakeEngine(), [Out("x"), Out("a", True)], [Out("b", True)])
        return await Choices(streams).result()

    assert [o.new_text for o in asyncio.run(go())] == ["xa", "b"]  # a stream merges its backlog


def test_choice_seeds_and_ids():
    p = SamplingParams(max_tokens=4, seed=INT32_MAX - 1)
    assert [q.seed for q in sample_choices(p, 3)] == [INT32_MAX - 1, INT32_MAX, 0]
    assert sample_choices(SamplingParams(max_tokens=4), 2)[1].seed is None  # drawn per request
    assert choice_request_ids("cmpl-1", 1) == ["cmpl-1"]
    assert choice_request_ids("cmpl-1", 2) == ["cmpl-1-0", "cmpl-1-1"]
