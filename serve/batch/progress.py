"""The job's progress: a tqdm bar (requests, output tokens/s, failures, ETA) where tqdm is
installed and stderr is a terminal, else a log line every `log_every_s` seconds."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from serve.batch.output import Totals

logger = logging.getLogger(__name__)


class Progress:
    def __init__(self, total: int, initial: int, enabled: bool, log_every_s: float = 10.0):
        self.total, self.done = total, initial
        self._start = self._last = time.monotonic()
        self._tokens = self._failed = self._run_done = 0
        self._enabled, self._log_every_s = enabled, log_every_s
        self._bar = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                # disable=None: no bar when stderr is not a terminal (a log file, CI)
                self._bar = tqdm(
                    total=total, initial=initial, unit="req", disable=None, smoothing=0.05
                )
                if self._bar.disable:
                    self._bar = None

    def update(self, done: Totals) -> None:
        self.done += done.requests
        self._run_done += done.requests
        self._tokens += done.completion_tokens
        self._failed += done.failed
        now = time.monotonic()
        if self._bar is not None:
            self._bar.update(done.requests)
            if now - self._last >= 0.5:
                self._last = now
                self._bar.set_postfix(
                    {"tok/s": f"{self._tokens / (now - self._start):.0f}", "failed": self._failed},
                    refresh=False,
                )
        elif self._enabled and now - self._last >= self._log_every_s:
            self._last = now
            rate = self._run_done / max(now - self._start, 1e-9)
            logger.info(
                "%d/%d requests, %.0f output tok/s, %d failed, ETA %s",
                self.done,
                self.total,
                self._tokens / (now - self._start),
                self._failed,
                _eta(self.total - self.done, rate),
            )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _eta(left: int, rate: float) -> str:
    if rate <= 0:
        return "?"
    s = int(left / rate)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"
