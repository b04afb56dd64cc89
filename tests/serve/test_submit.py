"""ServeContext.submit hands a request's choices to the engine together: every choice is sent
before any acceptance is awaited, and a refusal or a client that leaves withdraws them all. Over
a fake engine whose acceptances are released by hand."""

from __future__ import annotations

import asyncio

import pytest

from nori_jax.async_engine import RequestStream
from nori_jax.core.scheduler import QueueFullError
from nori_jax.sampling_params import SamplingParams
from serve.context import ServeContext
from serve.errors import ApiError
from serve.settings import ServerSettings


class HeldEngine:
    """add_request records the choice, then waits for `release` before accepting it (as the
    engine core's acknowledgement comes a step later); `refuse` names a choice to refuse."""

    tokenizer = None
    max_model_len = 64

    def __init__(self, refuse: str | None = None):
        self.sent: list[str] = []
        self.aborted: list[str] = []
        self.release = asyncio.Event()
        self.refuse = refuse

    async def add_request(self, prompt, params, request_id, timeout_s=None, priority=0):
        self.sent.append(request_id)
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.aborted.append(request_id)  # as the real clients withdraw one not yet accepted
            raise
        if request_id == self.refuse:
            raise QueueFullError("the waiting queue is full")
        return RequestStream(request_id, self, None)

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def _context(engine: HeldEngine) -> ServeContext:
    return ServeContext(engine, ServerSettings(model_name="m"), None, engine.max_model_len)


PROMPTS = [([1, 2, 3], SamplingParams(max_tokens=4)), ([4, 5], SamplingParams(max_tokens=4))]


def test_every_choice_is_sent_before_any_is_accepted() -> None:
    async def run() -> None:
        engine = HeldEngine()
        submit = asyncio.ensure_future(_context(engine).submit(PROMPTS, "r", n=3))
        for _ in range(10):
            await asyncio.sleep(0)
        # One at a time, the second would wait for the first's acceptance: here all 6 are out.
        assert engine.sent == [f"r-{i}" for i in range(6)] and not submit.done()
        engine.release.set()
        choices = await submit
        assert [s.request_id for s in choices.streams] == engine.sent
        assert engine.aborted == []

    asyncio.run(run())


def test_a_refused_choice_withdraws_the_others() -> None:
    async def run() -> None:
        engine = HeldEngine(refuse="r-4")
        engine.release.set()
        with pytest.raises(ApiError) as refused:
            await _context(engine).submit(PROMPTS, "r", n=3)
        assert refused.value.status == 429
        assert sorted(engine.aborted) == ["r-0", "r-1", "r-2", "r-3", "r-5"]

    asyncio.run(run())


def test_a_client_that_leaves_while_choices_are_handed_over_withdraws_them_all() -> None:
    async def run() -> None:
        engine = HeldEngine()
        submit = asyncio.ensure_future(_context(engine).submit(PROMPTS, "r", n=3))
        for _ in range(10):
            await asyncio.sleep(0)
        submit.cancel()
        with pytest.raises(asyncio.CancelledError):
            await submit
        assert sorted(engine.aborted) == sorted(engine.sent) and len(engine.sent) == 6

    asyncio.run(run())
