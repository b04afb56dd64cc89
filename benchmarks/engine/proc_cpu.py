"""Sample the CPU use of a process and its descendants, once a second, until it exits.

    python benchmarks/engine/proc_cpu.py PID OUT.csv &

Each row: time, pid, thread id, command (its first words) and thread name, share of one core used
since the last sample (user + system, from /proc/PID/task/TID/stat). A Python process's threads
share one GIL, so their sum near 100% means that process is CPU-bound. Used beside a served
sweep to tell which process, the API server or the engine core, runs out of CPU first
(`python proc_cpu.py summarize OUT.csv` prints each process's busiest second and busiest
threads). Linux only; no dependencies.
"""

from __future__ import annotations

import csv
import os
import sys
import time

TICK = os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out


def _tree(pid: int) -> list[int]:
    todo, seen = [pid], []
    while todo:
        p = todo.pop()
        seen.append(p)
        todo += _children(p)
    return seen


def _cpu_ticks(pid: int, tid: int | None = None) -> int | None:
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    try:
        with open(path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime, stime
    except OSError:
        return None


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            words = f.read().split(b"\0")
        return " ".join(w.decode(errors="replace").rsplit("/", 1)[-1] for w in words[:3])
    except OSError:
        return "?"


def _threads(pid: int) -> list[tuple[int, str]]:
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                out.append((int(tid), f.read().strip()))
    except OSError:
        pass
    return out


def sample(root: int, path: str, interval: float = 1.0) -> None:
    last: dict[int, tuple[float, int]] = {}
    commands: dict[int, str] = {}
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["time", "pid", "tid", "command", "thread", "cpu"])
        while _cpu_ticks(root) is not None:
            now = time.time()
            for pid in _tree(root):
                cmd = commands.setdefault(pid, _command(pid))
                for tid, name in _threads(pid):
                    ticks = _cpu_ticks(pid, tid)
                    if ticks is None:
                        continue
                    if tid in last:
                        t0, k0 = last[tid]
                        cpu = (ticks - k0) / TICK / (now - t0)
                        w.writerow([f"{now:.2f}", pid, tid, cmd, name, f"{cpu:.3f}"])
                    last[tid] = (now, ticks)
            f.flush()
            time.sleep(interval)


def summarize(path: str) -> None:
    """Per process: its busiest second (all threads together) and its busiest threads."""
    per_second: dict[tuple[str, str], dict[str, float]] = {}
    per_thread: dict[tuple[str, str], list[float]] = {}
    with open(path) as f:
        for r in csv.DictReader(f):
            key = (r["pid"], r["command"])
            sec = per_second.setdefault(key, {})
            sec[r["time"]] = sec.get(r["time"], 0.0) + float(r["cpu"])
            per_thread.setdefault((r["pid"], r["thread"]), []).append(float(r["cpu"]))
    for (pid, cmd), sec in sorted(per_second.items(), key=lambda kv: -max(kv[1].values())):
        if max(sec.values()) < 0.05:
            continue
        busy = sorted(
            ((max(v), name) for (p, name), v in per_thread.items() if p == pid), reverse=True
        )[:3]
        threads = ", ".join(f"{name} {m:.0%}" for m, name in busy)
        print(
            f"pid {pid} ({cmd[:50]}): busiest second {max(sec.values()):.0%} of a core "
            f"(threads: {threads})"
        )


if __name__ == "__main__":
    if sys.argv[1] == "summarize":
        summarize(sys.argv[2])
    else:
        sample(int(sys.argv[1]), sys.argv[2])
