"""One client process's work: its share of the schedule, streamed over aiohttp from one event loop.

Requests leave at their scheduled arrival times (never earlier, as early as the loop allows),
within this process's share of --max-concurrency. Times are seconds on the run's clock,
`time.perf_counter()` minus the run start `t0`, which every client process derives from one
wall-clock instant. A token's time is taken when its bytes are handed over, before any JSON
parsing. Only chunks that carry generated text count: chat servers (vLLM's among them) open the
stream with an empty `{"role": "assistant"}` delta before any token exists, and timing that chunk
would report a TTFT of a few milliseconds whatever the prefill cost.

The loop also measures its own lag and CPU use, the evidence for "the client is the bottleneck".
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any

import aiohttp

_LOOP_PROBE_S = 0.005  # event-loop lag probe period
NOT_SENT = "interrupted before it was sent"
_HEAD_BYTES = 256  # of a body kept to quote when it is no event stream
_SSE_FIELDS = (b"data:", b":", b"event:", b"id:", b"retry:")


def request_body(
    chat: bool,
    model: str,
    prompt: str | list[int],
    max_tokens: int,
    max_tokens_field: str,
    options: Mapping[str, Any],
) -> bytes:
    """A streaming request with usage in the last chunk; `options` are the other body fields."""
    body: dict[str, Any] = {"model": model}
    if chat:
        if not isinstance(prompt, str):
            raise ValueError("chat requests take a text prompt, got token ids")
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    body |= {
        max_tokens_field: max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    # allow_nan=False: NaN is no JSON, and a server would refuse (or misread) every request
    return json.dumps(body | options, separators=(",", ":"), allow_nan=False).encode()


@dataclasses.dataclass(frozen=True)
class WireRequest:
    index: int
    arrival_s: float
    body: bytes


@dataclasses.dataclass
class RequestResult:
    index: int
    scheduled_s: float  # from the arrival schedule
    dispatched_s: float = math.nan  # when the loop got to it (send lag = this - scheduled)
    sent_s: float = math.nan  # when the HTTP request started (after any concurrency slot)
    success: bool = False
    error: str = NOT_SENT
    http_status: int | None = None
    ttft_s: float = 0.0
    latency_s: float = 0.0  # E2E: send to the last token (to the failure for failed requests)
    itl_s: list[float] = dataclasses.field(default_factory=list)  # gaps between text chunks
    output_tokens: int = 0
    # "usage" (the server's count), "tokenizer" (the generated text tokenized, run.py) or
    # "chunks" (text chunks counted: a server sending several tokens a chunk is undercounted)
    output_tokens_source: str = "chunks"
    usage_invalid: bool = False  # the server sent a usage count that is no int >= 0
    usage_below_chunks: bool = False  # its count was below the text chunks it sent
    server_prompt_tokens: int | None = None
    finish_reason: str | None = None
    generated_text: str = ""


@dataclasses.dataclass(frozen=True)
class ShardSpec:
    url: str
    headers: dict[str, str]
    chat: bool
    timeout_s: float | None  # None: no timeout
    concurrency: int | None  # this process's share of --max-concurrency
    requests: list[WireRequest]
    warmup: list[WireRequest]


@dataclasses.dataclass
class ShardOutcome:
    results: list[RequestResult]
    loop_lags_s: list[float]  # how late each event-loop probe woke up
    cpu_util: float  # process CPU time / wall time over the run; ~1.0 means saturated
    warmup_errors: list[str]


async def run_shard(
    spec: ShardSpec,
    start: Callable[[], Awaitable[float | None]],
    stop: asyncio.Event,
    progress: Callable[[int], None],
) -> ShardOutcome:
    """Warm up, wait for the common start instant (None: stopped), run; `stop` interrupts."""
    results = [RequestResult(r.index, r.arrival_s) for r in spec.requests]
    warm = [RequestResult(r.index, 0.0) for r in spec.warmup]
    lags: list[float] = []
    slots = asyncio.Semaphore(spec.concurrency) if spec.concurrency else None
    connector = aiohttp.TCPConnector(limit=0)  # the concurrency cap is ours, not the pool's
    async with aiohttp.ClientSession(
        connector=connector, headers=spec.headers, timeout=aiohttp.ClientTimeout(total=None)
    ) as session:

        async def one(req: WireRequest, result: RequestResult, t0: float, count: bool) -> None:
            async with slots or contextlib.nullcontext():
                try:
                    await _send(session, spec, req.body, t0, result)
                except Exception as e:  # a client bug fails this request, never its TaskGroup
                    result.success, result.error = False, f"client error {type(e).__name__}: {e}"
            if count:
                progress(1)

        async def warm_up() -> None:
            now = time.perf_counter()
            async with asyncio.TaskGroup() as tg:
                for req, result in zip(spec.warmup, warm, strict=True):
                    tg.create_task(one(req, result, now, False))

        async def schedule(t0: float) -> None:
            async with asyncio.TaskGroup() as tg:
                for req, result in zip(spec.requests, results, strict=True):
                    if (delay := t0 + req.arrival_s - time.perf_counter()) > 0:
                        await asyncio.sleep(delay)
                    result.dispatched_s = time.perf_counter() - t0
                    tg.create_task(one(req, result, t0, True))

        cpu_util = 0.0
        if await _unless_stopped(warm_up(), stop) and (start_wall := await start()) is not None:
            t0 = time.perf_counter() + (start_wall - time.time())
            cpu0, wall0 = time.process_time(), time.perf_counter()
            watcher = asyncio.create_task(_watch_loop(lags, t0))
            await _unless_stopped(schedule(t0), stop)
            watcher.cancel()
            wall = time.perf_counter() - wall0
            cpu_util = (time.process_time() - cpu0) / wall if wall > 0 else 0.0
    return ShardOutcome(results, lags, cpu_util, [r.error for r in warm if not r.success])


async def _unless_stopped(work: Coroutine[Any, Any, None], stop: asyncio.Event) -> bool:
    """Run `work` to its end (True), or cancel it when `stop` is set first (False)."""
    task, stopped = asyncio.ensure_future(work), asyncio.ensure_future(stop.wait())
    await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if task.done():
        task.result()  # a failure of the client itself (not of a request) is the worker's error
        return True
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return False


async def _watch_loop(lags: list[float], t0: float) -> None:
    """Event-loop lag: a busy loop timestamps chunks late, which inflates ITL and TTFT."""
    await asyncio.sleep(max(0.0, t0 - time.perf_counter()))
    while True:
        before = time.perf_counter()
        await asyncio.sleep(_LOOP_PROBE_S)
        lags.append(time.perf_counter() - before - _LOOP_PROBE_S)


async def _send(
    session: aiohttp.ClientSession, spec: ShardSpec, body: bytes, t0: float, r: RequestResult
) -> None:
    """Send, stream and time one request into `r`; every failure becomes its reason."""
    stream = SseStream(spec.chat, time.perf_counter())
    r.sent_s = stream.sent - t0
    try:
        async with asyncio.timeout(spec.timeout_s):
            async with session.post(spec.url, data=body) as resp:
                r.http_status = resp.status
                if resp.status != 200:
                    stream.fail(error_from_body(resp.status, await resp.read()))
                else:
                    stream.content_type = resp.headers.get("Content-Type", "")
                    async for data in resp.content.iter_any():
                        if stream.feed(data, time.perf_counter()):
                            break
        stream.finish()
    except TimeoutError:
        after = "" if spec.timeout_s is None else f" after {spec.timeout_s:g} s"
        stream.fail(f"timeout{after} ({len(stream.times)} text chunks received)")
    except asyncio.CancelledError:
        stream.fail("interrupted before it finished")
        raise
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError) as e:
        stream.fail(f"connection closed by the server mid-response ({type(e).__name__})")
    except (aiohttp.ClientError, OSError) as e:  # refused, reset, unreachable
        stream.fail(f"{type(e).__name__}: {e}")
    except Exception as e:  # a benchmark must end: any client-side surprise is a failed request
        stream.fail(f"client error {type(e).__name__}: {e}")
    finally:
        stream.fill(r, time.perf_counter())


class SseStream:
    """SSE decoding and timing state of one response."""

    def __init__(self, chat: bool, sent: float) -> None:
        self.chat, self.sent = chat, sent
        # Bytes of an unfinished line, in the pieces they came in: one event of megabytes comes
        # in many reads, and re-joining the whole buffer on each would be quadratic.
        self.pending: list[bytes] = []
        self.content_type = ""  # of a 200 response (set by _send)
        self.head = b""  # the body's first bytes: quoted when it is no event stream at all
        self.saw_data = False  # any `data:` line
        self.saw_sse = False  # any line shaped like an SSE field or comment
        self.times: list[float] = []  # perf_counter of each text chunk
        self.text: list[str] = []
        self.usage_tokens: int | None = None
        self.prompt_tokens: int | None = None
        self.usage_invalid = False
        self.finish_reason: str | None = None
        self.done = False
        self.error: str | None = None

    def feed(self, data: bytes, now: float) -> bool:
        """Consume SSE bytes that arrived at `now`; True once the stream is over: failed, or
        [DONE] seen (a server may keep the connection open after it: reading on would wait)."""
        if len(self.head) < _HEAD_BYTES:
            self.head += data[: _HEAD_BYTES - len(self.head)]
        if b"\n" not in data:  # only the newest piece can end the pending line
            self.pending.append(data)
            return False
        lines = b"".join([*self.pending, data]).split(b"\n")
        self.pending = [lines.pop()]
        for line in lines:
            self._line(line, now)
            if self.error is not None or self.done:
                return True
        return False

    def finish(self) -> None:
        rest = b"".join(self.pending)
        if rest.strip() and not self.done and self.error is None:
            self._line(rest, time.perf_counter())  # a last event without its newline
        if self.error is None and not self.saw_data and self._not_sse():
            self.fail(self._not_an_event_stream())
        elif self.error is None and not self.done and self.finish_reason is None:
            self.fail(f"stream closed before the end ({len(self.times)} text chunks received)")
        elif self.error is None and not self.times:
            # Tokens whose text is empty (special tokens the server skips) end up here too: the
            # usage count tells that apart from a server that generated nothing.
            usage = "" if self.usage_tokens is None else f" (usage: {self.usage_tokens} tokens)"
            self.fail(f"stream ended without any generated text{usage}")

    def fail(self, reason: str) -> None:
        if self.error is None:
            self.error = reason

    def _not_sse(self) -> bool:
        """Another content-type, or a body none of whose lines is an SSE field."""
        if self.content_type and "text/event-stream" not in self.content_type:
            return True
        return bool(self.head.strip()) and not self.saw_sse

    def _not_an_event_stream(self) -> str:
        """A 200 answer without a single `data:` line: a server that ignored `stream: true`, or a
        proxy's page. Its content-type and first bytes say which."""
        start = self.head[:200].decode(errors="replace")
        return (
            f"the response is not an event stream (content-type {self.content_type or 'none'!r}"
            f", body starts {start!r})"
        )

    def _line(self, line: bytes, now: float) -> None:
        line = line.strip()
        if line.startswith(_SSE_FIELDS):
            self.saw_sse = True
        if not line.startswith(b"data:"):
            return  # blank separators, ": ping" comments, event:/id: fields
        self.saw_data = True
        payload = line[5:].strip()
        if payload == b"[DONE]":
            self.done = True
            return
        try:
            obj = json.loads(payload.decode())  # str: json skips its encoding sniffing
        except (json.JSONDecodeError, UnicodeDecodeError):
            obj = None
        if not isinstance(obj, dict):
            self.fail(f"malformed stream event: {payload[:200]!r}")
            return
        if "error" in obj and not obj.get("choices"):
            self.fail(f"server error in stream: {_error_message(obj)}")
            return
        choices = obj.get("choices")
        if choices and isinstance(choices, list) and isinstance(choices[0], dict):
            if not self._choice(choices[0], now):
                self.fail(f"malformed stream event: {payload[:200]!r}")
                return
        usage = obj.get("usage")
        if usage is not None:
            self._usage(usage)

    def _choice(self, choice: dict[str, Any], now: float) -> bool:
        """Record a choice's text and finish reason; False when their types are wrong."""
        if self.chat:  # reasoning models stream their thinking first: output tokens too
            delta = choice.get("delta") or {}
            if not isinstance(delta, dict):
                return False
            text = delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
        else:
            text = choice.get("text")
        finish = choice.get("finish_reason")
        if not isinstance(text, str | None) or not isinstance(finish, str | None):
            return False
        if text:
            self.times.append(now)
            self.text.append(text)
        self.finish_reason = finish or self.finish_reason
        return True

    def _usage(self, usage: Any) -> None:
        """Counts only when they are ints >= 0: a server's lie must not crash the metrics nor
        turn into negative token counts (a rejected count is absent, and counted in a warning)."""
        if not isinstance(usage, dict):
            self.usage_invalid = True
            return
        for key, attr in (
            ("completion_tokens", "usage_tokens"),
            ("prompt_tokens", "prompt_tokens"),
        ):
            value = usage.get(key)
            if value is None:
                continue
            if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                setattr(self, attr, value)
            else:
                self.usage_invalid = True

    def fill(self, r: RequestResult, now: float) -> None:
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
        r.usage_invalid = self.usage_invalid
        chunks = len(self.times)
        # Each text chunk holds at least one token: a usage count below them is wrong, and
        # taking it would drop TPOT samples (a request "of one token" has none).
        r.usage_below_chunks = self.usage_tokens is not None and self.usage_tokens < chunks
        if self.usage_tokens is not None and not r.usage_below_chunks:
            r.output_tokens, r.output_tokens_source = self.usage_tokens, "usage"
        else:
            r.output_tokens, r.output_tokens_source = chunks, "chunks"


def error_from_body(status: int, body: bytes) -> str:
    """'HTTP 503: <message>' from an error response, whatever shape its JSON has."""
    message = body[:300].decode(errors="replace").strip()
    with contextlib.suppress(ValueError, TypeError, AttributeError):
        message = _error_message(json.loads(body))
    return f"HTTP {status}: {message}" if message else f"HTTP {status}"


def _error_message(obj: Any) -> str:
    if isinstance(obj, dict):
        err = obj.get("error", obj.get("detail", obj.get("message", obj)))
        if isinstance(err, dict):
            err = err.get("message", err)
        return str(err)[:300]
    return str(obj)[:300]
