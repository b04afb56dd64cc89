"""Soak: a sustained Poisson load for a set duration, sampled over time, and nothing lost.

    # against a running server
    python benchmarks/reliability/soak.py --url http://127.0.0.1:8000 --rate 48 --duration 1800
    # or start one (its process tree's memory is then sampled too)
    python benchmarks/reliability/soak.py --rate 48 --duration 1800 --plot soak.png \\
        --serve "--config h200-throughput --model smollm2-135m --load-format dummy \\
                 --max-num-seqs 1024 --max-num-batched-tokens 8192"

Requests are streamed /v1/completions with token-id prompts and `ignore_eos` (exact lengths,
lognormal by default: the PERF workload of `nori-jax bench`), arriving as a Poisson process. Every
`--interval` seconds it samples, for the window: completed requests, output tok/s, E2E and TTFT
percentiles, the server's gauges (running, waiting, KV usage) and the memory of the server's
process tree. At the end it prints the table and a summary and checks that nothing was lost:
every request sent ended, with its full output or an error, the server counted each one it
finished, and the server went back to idle (no request running or waiting, no KV page in use).
Exit status 1 if a check fails. Needs the bench extra (aiohttp): pip install -e '.[bench]'.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from nori_jax.bench.workload import DEFAULT_INPUT, DEFAULT_OUTPUT, LognormalLengths


@dataclasses.dataclass
class Outcome:
    sent: float
    first_token: float | None = None
    end: float | None = None
    tokens: int = 0
    status: str = "pending"  # ok | error:<code> | transport:<kind>


def metrics_snapshot(text: str) -> dict[str, float]:
    """The unlabelled samples of a Prometheus exposition, labelled counters summed per name."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith(("_bucket", "_created")):
                continue
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def finished_by_reason(text: str) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "nori:request_success_total":
                out[s.labels["finished_reason"]] = s.value
    return out


def tree_rss_mb(pid: int | None) -> float | None:
    """Resident memory of a process and its descendants (Linux /proc), in MiB."""
    if pid is None:
        return None
    total, todo, seen = 0, [pid], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
            for task in Path(f"/proc/{p}/task").iterdir():
                kids = (task / "children").read_text().split()
                todo += [int(k) for k in kids]
        except (OSError, ValueError):
            continue
    return total / 1024


async def one_request(
    http: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int, out: Outcome
) -> None:
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    try:
        async with http.post(f"{url}/v1/completions", json=body) as r:
            if r.status != 200:
                err = await r.json(content_type=None)
                out.status = f"error:{err['error'].get('code') or r.status}"
                return
            tail = b""
            async for chunk in r.content.iter_any():
                if out.first_token is None:
                    out.first_token = time.perf_counter()
                tail = (tail + chunk)[-4096:]
            events = [e for e in tail.split(b"\n\n") if e.startswith(b"data: ")]
            if not events or events[-1] != b"data: [DONE]":
                out.status = "error:no_done"
                return
            last = json.loads(events[-2][len(b"data: ") :])
            if "error" in last:
                out.status = f"error:{last['error'].get('code')}"
                return
            out.tokens = last["usage"]["completion_tokens"]
            out.status = "ok" if out.tokens == max_tokens else "error:short"
    except (TimeoutError, aiohttp.ClientError) as e:
        out.status = f"transport:{type(e).__name__}"
    finally:
        out.end = time.perf_counter()


def window_row(outcomes: list[Outcome], t0: float, t1: float) -> dict[str, float]:
    done = [o for o in outcomes if o.end is not None and t0 <= o.end < t1]
    ok = [o for o in done if o.status == "ok"]
    e2e = np.array([o.end - o.sent for o in ok]) if ok else np.zeros(0)
    ttft = np.array([o.first_token - o.sent for o in ok if o.first_token]) if ok else np.zeros(0)
    pct = lambda a, q: float(np.percentile(a, q)) if len(a) else float("nan")  # noqa: E731
    return {
        "completed": len(ok),
        "failed": len(done) - len(ok),
        "output_tok_s": sum(o.tokens for o in ok) / (t1 - t0),
        "e2e_p50_s": pct(e2e, 50),
        "e2e_p99_s": pct(e2e, 99),
        "ttft_p99_s": pct(ttft, 99),
    }


async def soak(args: argparse.Namespace, server_pid: int | None) -> dict:
    rng = np.random.default_rng(args.seed)
    inputs = LognormalLengths(args.input_mu, args.input_sigma, 1, args.max_input)
    outputs = LognormalLengths(args.output_mu, args.output_sigma, 1, args.max_output)
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    connector = aiohttp.TCPConnector(limit=0)
    outcomes: list[Outcome] = []
    samples: list[dict] = []
    lag = [0.0]
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        start_text = await (await http.get(f"{args.url}/metrics")).text()
        start = time.perf_counter()
        end = start + args.duration
        tasks: set[asyncio.Task] = set()

        async def sampler() -> None:
            t_prev = start
            while True:
                await asyncio.sleep(args.interval)
                now = time.perf_counter()
                text = await (await http.get(f"{args.url}/metrics")).text()
                m = metrics_snapshot(text)
                row = {"t_s": round(now - start, 1)} | window_row(outcomes, t_prev, now)
                row |= {
                    "running": m.get("nori:num_requests_running"),
                    "waiting": m.get("nori:num_requests_waiting"),
                    "kv_usage": m.get("nori:kv_cache_usage_perc"),
                    "rss_mb": tree_rss_mb(server_pid),
                    "client_lag_ms": lag[0] * 1e3,
                    "in_flight": len(tasks),
                }
                lag[0] = 0.0
                samples.append(row)
                print(_fmt(row), flush=True)
                t_prev = now
                if now >= end and not tasks:
                    return

        sampling = asyncio.create_task(sampler())
        next_at = start
        while next_at < end:
            now = time.perf_counter()
            if next_at > now:
                await asyncio.sleep(next_at - now)
            lag[0] = max(lag[0], time.perf_counter() - next_at)
            n_in = int(inputs.sample(1, rng)[0])
            prompt = rng.integers(0, args.vocab, n_in).tolist()
            o = Outcome(sent=time.perf_counter())
            outcomes.append(o)
            task = asyncio.create_task(
                one_request(http, args.url, prompt, int(outputs.sample(1, rng)[0]), o)
            )
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            next_at += rng.exponential(1.0 / args.rate)
        if tasks:
            await asyncio.wait(tasks)
        await sampling
        # Idle: the gauges come with the engine's next (idle) step.
        idle = {}
        for _ in range(50):
            idle = metrics_snapshot(await (await http.get(f"{args.url}/metrics")).text())
            if not idle.get("nori:num_requests_running") and not idle.get(
                "nori:kv_cache_usage_perc"
            ):
                break
            await asyncio.sleep(0.2)
        end_text = await (await http.get(f"{args.url}/metrics")).text()
    return _summary(outcomes, samples, start_text, end_text, idle, time.perf_counter() - start)


def _summary(outcomes, samples, start_text, end_text, idle, wall_s) -> dict:
    statuses: dict[str, int] = {}
    for o in outcomes:
        statuses[o.status] = statuses.get(o.status, 0) + 1
    before, after = finished_by_reason(start_text), finished_by_reason(end_text)
    counted = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    ok = statuses.get("ok", 0)
    checks = {
        "every request ended": statuses.get("pending", 0) == 0,
        "none failed": ok == len(outcomes),
        "the server counted each completion": counted.get("length", 0) == ok,
        "idle at the end: nothing running or waiting": not idle.get("nori:num_requests_running")
        and not idle.get("nori:num_requests_waiting"),
        "idle at the end: no KV page in use": not idle.get("nori:kv_cache_usage_perc"),
        "no recompiles": not idle.get("nori:recompiles_total"),
    }
    rss = [s["rss_mb"] for s in samples if s["rss_mb"] is not None]
    return {
        "wall_s": wall_s,
        "sent": len(outcomes),
        "completed": ok,
        "failed": len(outcomes) - ok,
        "statuses": statuses,
        "server_finished": counted,
        "rss_mb_start_end": [rss[0], rss[-1]] if rss else None,
        "kv_usage_start_end": [samples[0]["kv_usage"], samples[-1]["kv_usage"]]
        if samples
        else None,
        "checks": checks,
        "samples": samples,
    }


_COLUMNS = [
    ("t_s", "t (s)", "{:>7.1f}"),
    ("completed", "done", "{:>6d}"),
    ("failed", "failed", "{:>6d}"),
    ("output_tok_s", "out tok/s", "{:>10.0f}"),
    ("e2e_p50_s", "E2E P50", "{:>8.2f}"),
    ("e2e_p99_s", "E2E P99", "{:>8.2f}"),
    ("ttft_p99_s", "TTFT P99", "{:>9.3f}"),
    ("running", "run", "{:>5.0f}"),
    ("waiting", "wait", "{:>5.0f}"),
    ("kv_usage", "KV", "{:>5.2f}"),
    ("rss_mb", "RSS MiB", "{:>8.0f}"),
    ("client_lag_ms", "lag ms", "{:>7.1f}"),
]


def _width(title: str, spec: str) -> int:
    return max(len(title), len(spec.format(0)))


def _fmt(row: dict) -> str:
    cells = []
    for key, title, spec in _COLUMNS:
        v = row.get(key)
        text = "-" if v is None else spec.format(v).strip()
        cells.append(text.rjust(_width(title, spec)))
    return " ".join(cells)


def _header() -> str:
    return " ".join(title.rjust(_width(title, spec)) for _, title, spec in _COLUMNS)


def start_server(serve_args: str, port: int, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "nori_jax.cli", "--log-level", "warning", "serve"]
    cmd += shlex.split(serve_args) + ["--port", str(port), "--no-access-log"]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    import httpx

    deadline = time.monotonic() + 1800
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(1)
    raise SystemExit("the server did not come up")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", help="a running server (else --serve starts one)")
    p.add_argument("--serve", default=None, help="start `nori-jax serve` with these arguments")
    p.add_argument("--port", type=int, default=8125)
    p.add_argument("--pid", type=int, default=None, help="the server's pid, to sample its memory")
    p.add_argument("--rate", type=float, default=48.0, help="requests per second (Poisson)")
    p.add_argument("--duration", type=float, default=1800.0, help="seconds of arrivals")
    p.add_argument("--interval", type=float, default=60.0, help="seconds per sample row")
    p.add_argument("--vocab", type=int, default=49152, help="prompt token ids are below this")
    p.add_argument("--input-mu", type=float, default=DEFAULT_INPUT.mu)
    p.add_argument("--input-sigma", type=float, default=DEFAULT_INPUT.sigma)
    p.add_argument("--max-input", type=int, default=DEFAULT_INPUT.max_len)
    p.add_argument("--output-mu", type=float, default=DEFAULT_OUTPUT.mu)
    p.add_argument("--output-sigma", type=float, default=DEFAULT_OUTPUT.sigma)
    p.add_argument("--max-output", type=int, default=DEFAULT_OUTPUT.max_len)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="write the summary and samples (JSON)")
    p.add_argument("--plot", type=Path, default=None, help="throughput and P99 per sample (PNG)")
    args = p.parse_args(argv)
    proc = None
    pid = args.pid
    if args.url is None:
        if args.serve is None:
            p.error("give --url or --serve")
        log = (args.out or Path("soak.json")).with_suffix(".server.log")
        proc = start_server(args.serve, args.port, log)
        args.url, pid = f"http://127.0.0.1:{args.port}", proc.pid
    print(_header(), flush=True)
    try:
        summary = asyncio.run(soak(args, pid))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
    print(
        f"\n{summary['sent']} sent, {summary['completed']} completed, {summary['failed']} failed "
        f"in {summary['wall_s']:.0f} s; statuses {summary['statuses']}; server finished "
        f"{summary['server_finished']}"
    )
    print(
        f"RSS MiB start/end {summary['rss_mb_start_end']}, KV usage {summary['kv_usage_start_end']}"
    )
    for name, ok in summary["checks"].items():
        print(f"  [{'ok' if ok else 'FAIL'}] {name}")
    if args.out:
        args.out.write_text(json.dumps(summary, indent=1))
    if args.plot:
        _plot(summary["samples"], args.plot)
    return 0 if all(summary["checks"].values()) else 1


def _plot(samples: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s["t_s"] / 60 for s in samples]
    fig, (a, b) = plt.subplots(2, 1, sharex=True, figsize=(8, 5))
    a.plot(t, [s["output_tok_s"] for s in samples], marker="o")
    a.set_ylabel("output tok/s")
    b.plot(t, [s["e2e_p99_s"] for s in samples], marker="o", label="E2E P99")
    b.plot(t, [s["ttft_p99_s"] for s in samples], marker="o", label="TTFT P99")
    b.set_ylabel("seconds")
    b.set_xlabel("minutes")
    b.legend()
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
