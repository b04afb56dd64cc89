"""Is the client the bottleneck? Three symptoms, each with a warning that names its numbers.

- Send lag: a request leaves later than its scheduled arrival, so the offered load is not the
  planned Poisson/gamma process (checked at finite rates; at `inf` every request is "late").
- Event-loop lag: a busy loop reads chunks late, which inflates TTFT and ITL.
- CPU saturation: a client process busy nearly all of the time is about to show both.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from nori_jax.bench.shard import ShardOutcome

SEND_LAG_WARN_MS = 10.0
LOOP_LAG_WARN_MS = 10.0
# Timing error of a quarter of a typical token gap is already a visible distortion of ITL/TPOT.
LOOP_LAG_WARN_ITL_FRACTION = 0.25
LOOP_LAG_FLOOR_MS = 1.0  # below this, scheduler jitter of a healthy loop would raise alarms
CPU_UTIL_WARN = 0.9


@dataclasses.dataclass(frozen=True)
class ClientHealth:
    num_processes: int
    send_lag_p99_ms: float
    send_lag_max_ms: float
    loop_lag_p99_ms: float
    loop_lag_max_ms: float
    cpu_util_max: float  # busiest client process, CPU time / wall time


def assess(
    outcomes: Sequence[ShardOutcome], finite_rate: bool, median_itl_ms: float
) -> tuple[ClientHealth, list[str]]:
    send_lags = np.array(
        [
            r.dispatched_s - r.scheduled_s
            for o in outcomes
            for r in o.results
            if math.isfinite(r.dispatched_s)
        ]
    )
    loop_lags = np.concatenate([np.asarray(o.loop_lags_s, dtype=np.float64) for o in outcomes])
    health = ClientHealth(
        num_processes=len(outcomes),
        send_lag_p99_ms=_p99_ms(send_lags),
        send_lag_max_ms=float(send_lags.max() * 1e3) if send_lags.size else 0.0,
        loop_lag_p99_ms=_p99_ms(loop_lags),
        loop_lag_max_ms=float(loop_lags.max() * 1e3) if loop_lags.size else 0.0,
        cpu_util_max=max((o.cpu_util for o in outcomes), default=0.0),
    )
    advice = (
        "the client may be the bottleneck: give it more processes (--num-client-processes) "
        "or a machine with idle cores"
    )
    warnings = []
    if finite_rate and health.send_lag_p99_ms > SEND_LAG_WARN_MS:
        warnings.append(
            f"requests left the client late: P99 send lag {health.send_lag_p99_ms:.1f} ms "
            f"(max {health.send_lag_max_ms:.1f} ms) behind the schedule; {advice}"
        )
    loop_limit = LOOP_LAG_WARN_MS
    if median_itl_ms > 0:
        loop_limit = min(loop_limit, LOOP_LAG_WARN_ITL_FRACTION * median_itl_ms)
        loop_limit = max(loop_limit, LOOP_LAG_FLOOR_MS)
    if health.loop_lag_p99_ms > loop_limit:
        warnings.append(
            f"client event loop lagging: P99 {health.loop_lag_p99_ms:.1f} ms "
            f"(limit {loop_limit:.1f} ms, median ITL {median_itl_ms:.1f} ms), so chunk "
            f"timestamps are late; {advice}"
        )
    if health.cpu_util_max > CPU_UTIL_WARN:
        warnings.append(f"a client process used {health.cpu_util_max:.0%} of a CPU core; {advice}")
    return health, warnings


def _p99_ms(values_s: np.ndarray) -> float:
    return float(np.percentile(values_s, 99) * 1e3) if values_s.size else 0.0
