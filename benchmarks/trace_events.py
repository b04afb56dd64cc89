"""Events of a `jax.profiler.trace` directory (shared by the benchmark scripts).

Read with `jax.profiler.ProfileData`: every event of a "Stream" line of a "/device:GPU" plane
is one kernel (or copy) the device ran, with its start and duration in nanoseconds; the "/host:"
planes hold the host threads' annotated spans (Python frames, PjRt's and XLA's TraceMe events).
"""

from __future__ import annotations

import collections
import glob
import tempfile


def _planes(trace_dir: str):
    """Every plane of every trace file under `trace_dir`."""
    from jax.profiler import ProfileData

    for path in glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True):
        yield from ProfileData.from_file(path).planes


def device_kernels(trace_dir: str) -> list[tuple[str, int, int]]:
    """(name, start_ns, duration_ns) of every GPU stream event in the trace."""
    return [
        (e.name, int(e.start_ns), int(e.duration_ns))
        for plane in _planes(trace_dir)
        if plane.name.startswith("/device:GPU")
        for line in plane.lines
        if line.name.startswith("Stream")
        for e in line.events
    ]


def host_events(trace_dir: str) -> list[tuple[str, str, int, int]]:
    """(thread, name, start_ns, duration_ns) of every host-side event (XLA's and PjRt's TraceMe
    annotations: executable launches, thunks, command-buffer records and updates, transfers)."""
    return [
        (line.name, e.name, int(e.start_ns), int(e.duration_ns))
        for plane in _planes(trace_dir)
        if plane.name.startswith("/host:")
        for line in plane.lines
        for e in line.events
    ]


def busy_ns(events: list[tuple[str, int, int]]) -> int:
    """Length of the union of the event intervals."""
    total, end = 0, -1
    for _, start, dur in sorted(events, key=lambda e: e[1]):
        lo, hi = max(start, end), start + dur
        if hi > lo:
            total += hi - lo
        end = max(end, hi)
    return total


def traced_kernel_totals(run) -> collections.Counter:
    """run() (which blocks until its work is done) under the JAX profiler: the total device time
    of each GPU kernel, by name, in nanoseconds."""
    import jax

    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            run()
        events = device_kernels(trace_dir)
    total = collections.Counter()
    for name, _, dur in events:
        total[name] += dur
    return total


def largest_kernel_per_call(total: collections.Counter, calls: int) -> tuple[str, float, dict]:
    """Of `traced_kernel_totals`' result over `calls` calls: (the kernel with the most total time,
    its device time per call in us, every other kernel's per call in us, largest first). The
    kernel benchmarks time one kernel a call, which is the largest one in their traces."""
    top = max(total, key=total.get)
    others = {name: t / calls / 1e3 for name, t in total.most_common() if name != top}
    return top, total[top] / calls / 1e3, others
