"""One streaming request and its client-side timings (TTFT, ITL, E2E), failures included.

Times are seconds on the run's clock: `time.perf_counter()` minus the run start `t0`, which every
client process derives from the same wall-clock instant. Latencies are taken from the arrival of
the bytes that carry a token, before any JSON parsing, so parsing cost never shows up as latency.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time

from nori_jax.bench.config import EndpointKind
from nori_jax.bench.http1 import HttpClient, HttpError
from nori_jax.bench.wire import error_from_body, parse_data

_ERROR_BODY_BYTES = 2048


@dataclasses.dataclass(frozen=True)
class WireRequest:
    """A request as a client process sees it: when to send it and the bytes to send."""

    index: int
    arrival_s: float
    body: bytes
    max_tokens: int


@dataclasses.dataclass
class RequestResult:
    index: int
    scheduled_s: float  # from the arrival schedule
    dispatched_s: float = math.nan  # when the client's scheduler got to it (send lag = - sched)
    sent_s: float = math.nan  # when the HTTP request started (after any concurrency slot)
    success: bool = False
    error: str = ""
    http_status: int | None = None
    ttft_s: float = 0.0
    latency_s: float = 0.0  # E2E: send to the last token (to the failure for failed requests)
    itl_s: list[float] = dataclasses.field(default_factory=list)  # gaps between text chunks
    output_tokens: int = 0
    output_tokens_from_usage: bool = False
    server_prompt_tokens: int | None = None
    finish_reason: str | None = None
    generated_text: str = ""

    @property
    def num_chunks(self) -> int:
        return len(self.itl_s) + 1 if self.ttft_s > 0 else 0


async def send_request(
    client: HttpClient,
    request: WireRequest,
    endpoint: EndpointKind,
    timeout_s: float,
    t0: float,
    result: RequestResult,
) -> RequestResult:
    """Send, stream and time one request; never raises (every failure becomes a reason)."""
    sent = time.perf_counter()
    result.sent_s = sent - t0
    stream = _Stream(endpoint, sent)
    try:
        async with asyncio.timeout(timeout_s):
            await client.post(request.body, stream)
        stream.finish(time.perf_counter())
    except TimeoutError:
        stream.fail(f"timeout after {timeout_s:g} s ({len(stream.times)} text chunks received)")
    except HttpError as e:
        stream.fail(str(e))
    except OSError as e:  # refused, reset, unreachable
        stream.fail(f"{type(e).__name__}: {e}")
    except Exception as e:  # a benchmark must end: any client-side surprise is a failed request
        stream.fail(f"client error {type(e).__name__}: {e}")
    result.http_status = stream.status
    return stream.fill(result, time.perf_counter())


class _Stream:
    """SSE decoding and timing state of one response."""

    def __init__(self, endpoint: EndpointKind, sent: float) -> None:
        self.endpoint = endpoint
        self.sent = sent
        self.status: int | None = None
        self.error_body = b""  # the start of a non-200 response, for the failure reason
        self.buf = b""
        self.times: list[float] = []  # perf_counter of each text chunk
        self.text: list[str] = []
        self.usage_tokens: int | None = None
        self.prompt_tokens: int | None = None
        self.finish_reason: str | None = None
        self.done = False
        self.error: str | None = None

    # ResponseSink
    def on_head(self, status: int) -> None:
        self.status = status

    def on_body(self, data: bytes, now: float) -> None:
        if self.status != 200:
            self.error_body = (self.error_body + data)[:_ERROR_BODY_BYTES]
        elif self.error is None:
            self.feed(data, now)

    def feed(self, data: bytes, now: float) -> bool:
        """Consume SSE bytes that arrived at `now`; True once the stream has failed."""
        if self.done:
            return False
        lines = (self.buf + data).split(b"\n")
        self.buf = lines.pop()
        for line in lines:
            if self._line(line, now):
                return True
            if self.done:
                break
        return False

    def finish(self, now: float) -> None:
        if self.status != 200:
            self.fail(error_from_body(self.status or 0, self.error_body))
            return
        if self.buf.strip() and not self.done and self.error is None:
            self._line(self.buf, now)  # a last event without its trailing newline
        if self.error is None and not self.done and self.finish_reason is None:
            self.fail(f"stream closed before the end ({len(self.times)} text chunks received)")
        elif self.error is None and not self.times:
            self.fail("stream ended without any generated text")

    def fail(self, reason: str) -> None:
        if self.error is None:
            self.error = reason

    def _line(self, line: bytes, now: float) -> bool:
        line = line.strip()
        if not line.startswith(b"data:"):
            return False  # blank separators, ": ping" comments, event:/id: fields
        chunk = parse_data(line[5:].strip(), self.endpoint)
        if chunk.error is not None:
            self.fail(chunk.error)
            return True
        if chunk.done:
            self.done = True
            return False
        if chunk.text:
            self.times.append(now)
            self.text.append(chunk.text)
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason
        if chunk.completion_tokens is not None:
            self.usage_tokens = chunk.completion_tokens
        if chunk.prompt_tokens is not None:
            self.prompt_tokens = chunk.prompt_tokens
        return False

    def fill(self, r: RequestResult, now: float) -> RequestResult:
        r.success = self.error is None
        r.error = self.error or ""
        r.finish_reason = self.finish_reason
        r.server_prompt_tokens = self.prompt_tokens
        r.generated_text = "".join(self.text)
        if self.times:
            r.ttft_s = self.times[0] - self.sent
            r.itl_s = [b - a for a, b in zip(self.times[:-1], self.times[1:], strict=True)]
        # E2E ends at the last token (as vllm bench serve measures it); a failure ends at failing
        r.latency_s = (self.times[-1] if r.success else now) - self.sent
        if self.usage_tokens is not None:
            r.output_tokens, r.output_tokens_from_usage = self.usage_tokens, True
        else:
            r.output_tokens = len(self.times)
        return r
