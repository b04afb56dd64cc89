"""Streaming and waiting with the client in mind: a client that goes away aborts its request.

Two paths lead to an abort, so its KV pages return to the pool at once:
- streaming: Starlette cancels the response when the client disconnects; the response's own
  `finally` aborts the request (a generator's `finally` would wait for garbage collection when it
  is suspended at a `yield`);
- non-streaming: the handler races the result against the client's `http.disconnect`.
Errors after the headers went out (engine died, timeout) become one error event, then the end.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import msgspec
from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from nori_jax.core.outputs import RequestOutput
from serve.choices import Choices
from serve.errors import ApiError, api_error_from

SSE_DONE = b"data: [DONE]\n\n"


# Characters JSON leaves raw in a string that line splitters still break on (Python's
# str.splitlines, some SSE and NDJSON readers), as UTF-8: escaped, every event stays one line.
# (In valid UTF-8 these byte sequences are always these characters, never parts of others.)
_LINE_BREAKS = (
    (b"\xc2\x85", b"\\u0085"),
    (b"\xe2\x80\xa8", b"\\u2028"),
    (b"\xe2\x80\xa9", b"\\u2029"),
)
_encode = msgspec.json.Encoder().encode


def dumps_bytes(obj: Any) -> bytes:
    """Compact JSON as UTF-8 (msgspec's encoder: streamed events are the server's hottest path),
    one line whatever the text."""
    data = _encode(obj)
    for raw, escaped in _LINE_BREAKS:
        if raw in data:
            data = data.replace(raw, escaped)
    return data


def dumps(obj: Any) -> str:
    return dumps_bytes(obj).decode()


def sse(obj: Any) -> bytes:
    return b"data: " + dumps_bytes(obj) + b"\n\n"


def ndjson(obj: Any) -> bytes:
    return dumps_bytes(obj) + b"\n"


class EngineStreamingResponse(StreamingResponse):
    """A StreamingResponse that aborts its engine request however the response ends.

    Disconnects are seen because Starlette cancels a streaming response on `http.disconnect` for
    servers of ASGI spec < 2.4 (uvicorn's HTTP protocols are 2.3); test_concurrency checks it.
    """

    def __init__(self, content: AsyncIterator[bytes], choices: Choices, media_type: str):
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(content, media_type=media_type, headers=headers)
        self._choices = choices

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._choices.abort()  # a no-op once the request has finished


def stream_events(
    choices: Choices,
    events: Callable[[int, RequestOutput], Iterable[bytes]],
    *,
    head: Iterable[bytes] = (),
    tail: Callable[[], Iterable[bytes]] = lambda: (),
    encode_error: Callable[[dict[str, Any]], bytes] = sse,
    retry_after_s: int = 1,
) -> AsyncIterator[bytes]:
    """The body of a streaming response: head, the events of each (choice index, output), tail
    (or one error)."""

    async def body() -> AsyncIterator[bytes]:
        for event in head:
            yield event
        try:
            async for index, out in choices.outputs():
                for event in events(index, out):
                    yield event
        except Exception as e:  # engine died, timeout, shutdown (a bug is logged by api_error_from)
            yield encode_error(api_error_from(e, retry_after_s).body())
        finally:
            choices.abort()
        for event in tail():
            yield event

    return body()


async def result_unless_disconnected(request: Request, choices: Choices) -> list[RequestOutput]:
    """The final output of each choice. If the client disconnects first, the choices are aborted
    and a 499 raised (nginx's "client closed request": nobody is left to read it)."""
    result = asyncio.ensure_future(choices.result())
    gone = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not result.done():
            result.cancel()  # choices.result()'s own `finally` aborts the engine requests
    if result not in done:
        raise ApiError(499, "client disconnected", code="client_closed_request")
    return result.result()


async def _wait_disconnect(request: Request) -> None:
    # The body was read already, so the next ASGI message is the disconnect (or none at all).
    while (await request.receive())["type"] != "http.disconnect":
        pass
