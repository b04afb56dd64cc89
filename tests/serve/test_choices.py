"""`Choices`, the n streams of one request read as one, over scripted streams (no engine)."""

from __future__ import annotations

import asyncio

import pytest

from nori_jax.sampling_params import INT32_MAX, SamplingParams
from serve.choices import Choices, choice_params, choice_request_ids


class ScriptedStream:
    """A RequestStream's surface: yields its script's outputs (an exception is raised), then
    waits forever, as a stream whose request is still running does."""

    def __init__(self, script: list):
        self.script = list(script)
        self.aborted = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        await asyncio.sleep(0)
        if not self.script:
            await asyncio.Event().wait()  # still generating
        item = self.script.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    async def result(self):
        try:
            async for out in self:
                if out.finished:
                    return out
        finally:
            self.abort()

    def abort(self) -> None:
        self.aborted = True


class Out:
    def __init__(self, text: str, finished: bool = False):
        self.new_text, self.finished = text, finished


def _read(choices: Choices) -> list[tuple[int, str]]:
    async def go():
        return [(i, out.new_text) async for i, out in choices.outputs()]

    return asyncio.run(go())


def test_outputs_are_tagged_with_their_choice_and_every_stream_is_read_to_its_end():
    streams = [
        ScriptedStream([Out("a"), Out("b", True)]),
        ScriptedStream([Out("c", True)]),
        ScriptedStream([Out("d"), Out("e"), Out("f", True)]),
    ]
    got = _read(Choices(streams))
    assert sorted(got) == [(0, "a"), (0, "b"), (1, "c"), (2, "d"), (2, "e"), (2, "f")]
    for i in range(3):  # each choice's outputs in its own order
        assert [t for j, t in got if j == i] == sorted(t for j, t in got if j == i)


def test_a_failing_choice_fails_the_request_and_aborts_the_others():
    streams = [ScriptedStream([Out("a")]), ScriptedStream([RuntimeError("engine died")])]
    with pytest.raises(RuntimeError, match="engine died"):
        _read(Choices(streams))
    assert all(s.aborted for s in streams)


def test_result_fails_with_a_choice_and_leaves_no_wait_behind():
    streams = [ScriptedStream([Out("a")]), ScriptedStream([Out("b"), ValueError("bad")])]

    async def go():
        with pytest.raises(ValueError, match="bad"):
            await Choices(streams).result()
        await asyncio.sleep(0)
        return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    assert asyncio.run(go()) == []  # the still-running choice's wait was cancelled
    assert all(s.aborted for s in streams)


def test_result_gives_every_final_output_in_index_order():
    streams = [ScriptedStream([Out("x"), Out("a", True)]), ScriptedStream([Out("b", True)])]
    outs = asyncio.run(Choices(streams).result())
    assert [o.new_text for o in outs] == ["a", "b"]


def test_choice_seeds_and_ids():
    p = SamplingParams(max_tokens=4, seed=INT32_MAX - 1)
    assert [q.seed for q in choice_params(p, 3)] == [INT32_MAX - 1, INT32_MAX, 0]
    assert choice_params(SamplingParams(max_tokens=4), 2)[1].seed is None  # drawn per request
    assert choice_request_ids("cmpl-1", 1) == ["cmpl-1"]
    assert choice_request_ids("cmpl-1", 2) == ["cmpl-1-0", "cmpl-1-1"]
