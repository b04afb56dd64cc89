"""Parallel sampling (`n`): one prompt, n independent samples, as n engine requests.

The engine sees n requests with the same prompt; its scheduler admits the first, and the others
wait for its prompt pages to reach the prefix cache (`wait_for_shared_prefix`), so the prompt is
computed and held once. Choice i samples with the request's seed + i (modulo 2^31), the offline
API's rule too (`sampling_params.sample_choices`): a seeded request answers the same whatever runs
beside it, and its choices differ from one another.
`Choices` makes the n streams one: outputs tagged with their choice index, one abort for all.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from nori_jax.async_engine import RequestStream
from nori_jax.core.outputs import RequestOutput

MAX_N = 64  # choices per prompt: each is a sequence in the engine's batch
MAX_CHOICES = 256  # choices per request, of all its prompts (completions takes a batch of them)


def choice_request_ids(request_id: str, n: int, first: int = 0) -> list[str]:
    """The engine's id of each choice: the request's own id where it has one choice, else
    `<id>-<index>` (`first`: the index of the first, past earlier prompts' choices)."""
    return [request_id] if n == 1 and not first else [f"{request_id}-{first + i}" for i in range(n)]


class Choices:
    """The streams of one request's choices, read as one."""

    def __init__(self, streams: list[RequestStream]):
        self.streams = streams
        self._reads: dict[asyncio.Future[RequestOutput], int] = {}  # a pending read per choice

    def __len__(self) -> int:
        return len(self.streams)

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, output) as the engine produces them; raises (after aborting every
        choice) if any choice fails."""
        if len(self.streams) == 1:  # no merging: the common case stays one hop
            async for out in self.streams[0]:
                yield 0, out
            return
        for i in range(len(self.streams)):
            self._read(i)
        try:
            while self._reads:
                done, _ = await asyncio.wait(self._reads, return_when=asyncio.FIRST_COMPLETED)
                for read in sorted(done, key=self._reads.__getitem__):
                    i = self._reads.pop(read)
                    try:
                        out = read.result()  # a failed choice fails the request
                    except StopAsyncIteration:  # aborted from elsewhere: it says no more
                        continue
                    yield i, out
                    if not out.finished:
                        self._read(i)
        except BaseException:
            self.abort()
            raise

    async def result(self) -> list[RequestOutput]:
        """Every choice's final output, in index order; aborts them all if cancelled or if one
        fails."""
        waits = [asyncio.ensure_future(s.result()) for s in self.streams]
        try:
            return list(await asyncio.gather(*waits))
        finally:
            for wait in waits:  # gather leaves the others waiting when one fails
                wait.cancel()
            self.abort()

    def abort(self) -> None:
        """Stop every choice still generating (idempotent)."""
        for read in self._reads:
            read.cancel()
        self._reads.clear()
        for s in self.streams:
            s.abort()

    def _read(self, i: int) -> None:
        self._reads[asyncio.ensure_future(anext(self.streams[i]))] = i
