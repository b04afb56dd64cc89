"""What every request passes before the app sees it (pure ASGI, so nothing is parsed yet):

1. the API key, from the headers alone, on every path but the open ones (OPEN_PATHS: /health,
   /metrics, /openapi.json, /docs, /redoc), so an unknown path without the key gets a 401;
2. the body's size: a Content-Length over the limit is refused at once, and a body without one is
   read only up to the limit (413);
3. the body's read time: a client that does not send its body within the timeout gets a 408.

Every refusal is the OpenAI-style JSON error. The body is then handed to the app as it was read.
"""

from __future__ import annotations

import asyncio
import secrets
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serve.errors import ApiError
from serve.settings import ServerSettings

OPEN_PATHS = ("/health", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc")


def is_guarded(path: str) -> bool:
    return path not in OPEN_PATHS


class RequestGuard:
    def __init__(self, app: ASGIApp, settings: ServerSettings):
        self.app, self.settings = app, settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.settings.api_server is not None:  # several API server processes: say which
            send = _with_header(send, b"x-nori-api-server", str(self.settings.api_server).encode())
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        try:
            self._check_key(scope["path"], headers)
            body = await self._read_body(headers, receive)
        except ApiError as e:
            await e.response()(scope, receive, send)
            return
        await self.app(scope, _replay(body, receive), send)

    def _check_key(self, path: str, headers: dict[str, str]) -> None:
        key = self.settings.api_key
        if key is None or not is_guarded(path):
            return
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(
            token.strip().encode(), key.encode()
        ):
            raise ApiError(
                401,
                "invalid or missing API key (send 'Authorization: Bearer <key>')",
                "authentication_error",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    async def _read_body(self, headers: dict[str, str], receive: Receive) -> bytes:
        limit = self.settings.max_body_bytes
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise _too_large(f"the request body has {int(length)} bytes", limit)
        chunks, size = [], 0
        deadline = time.monotonic() + self.settings.body_timeout_s
        while True:
            try:
                async with asyncio.timeout_at(_loop_time(deadline)):
                    message = await receive()
            except TimeoutError:
                raise ApiError(
                    408,
                    f"the request body did not arrive within {self.settings.body_timeout_s:g} s",
                    code="request_timeout",
                ) from None
            if message["type"] == "http.disconnect":
                raise ApiError(499, "client disconnected", code="client_closed_request")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _too_large("the request body is larger", limit)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _too_large(what: str, limit: int) -> ApiError:
    return ApiError(
        413,
        f"{what}; this server takes at most {limit} bytes (--max-body-size)",
        code="request_too_large",
    )


def _loop_time(deadline: float) -> float:
    """A time.monotonic() deadline on the running loop's clock."""
    loop = asyncio.get_running_loop()
    return loop.time() + (deadline - time.monotonic())


def _with_header(send: Send, name: bytes, value: bytes) -> Send:
    async def sent(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), (name, value)]}
        await send(message)

    return sent


def _replay(body: bytes, receive: Receive) -> Receive:
    """The body as one message, then the client's own messages (its disconnect)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
