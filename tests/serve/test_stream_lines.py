"""Streamed JSON stays one event per line for line-based readers: the characters JSON leaves raw
in strings but str.splitlines (and some SSE / NDJSON readers) break on are sent escaped."""

from __future__ import annotations

import json

from serve.streaming import ndjson, sse


def test_events_stay_one_line_whatever_the_text() -> None:
    text = "a\u2028b\u2029c\x85d\x1ce\x1df\x1eg\x0bh\x0ci\nj\rk é 字"
    for event in (ndjson({"text": text}), sse({"text": text})):
        lines = [line for line in event.decode().splitlines() if line]
        assert len(lines) == 1
        assert json.loads(lines[0].removeprefix("data: "))["text"] == text
