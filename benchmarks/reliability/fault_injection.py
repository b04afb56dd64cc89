"""Fault injection against a real `nori-jax serve`: engine death under load, a storm of client
disconnects, SIGTERM under load. Every request must be accounted for: it completes in full or ends
with the JSON error its fault calls for, never a hang, a cut stream or a 5xx it should not get.

    # CPU, a minute or two:
    python benchmarks/reliability/fault_injection.py --serve "--config tiny-cpu" --vocab 512 \\
        --input-mu 3.5 --max-input 100 --output-mu 4 --max-output 150
    # H200 (SmolLM2-135M shape at the knee rate):
    python benchmarks/reliability/fault_injection.py --rate 48 \\
        --serve "--config h200-throughput --model smollm2-135m --load-format dummy \\
                 --max-num-seqs 1024 --max-num-batched-tokens 8192"

Engine death: SIGKILL of the engine-core process in the middle of a Poisson load that keeps
arriving. Requests in flight end with 500 engine_dead, those arriving while it restarts with 503
engine_unavailable, and after the restart everything completes again. Recovery time is measured
from the kill to /health answering 200 again (and as the server's own
nori:engine_recovery_seconds, death detected to the new core ready). Prints one table row per
scenario; exit status 1 if any request is unaccounted for.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np
from soak import Outcome, metrics_snapshot, one_request, start_server

from nori_jax.bench.workload import DEFAULT_INPUT, DEFAULT_OUTPUT, LognormalLengths


def children(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids += [int(k) for k in (task / "children").read_text().split()]
    return kids


class Load:
    """A Poisson stream of streamed completions; `outcomes` holds every request sent."""

    def __init__(self, args: argparse.Namespace, http: aiohttp.ClientSession, seed: int):
        self.args, self.http = args, http
        self.rng = np.random.default_rng(seed)
        self.inputs = LognormalLengths(args.input_mu, args.input_sigma, 1, args.max_input)
        self.outputs = LognormalLengths(args.output_mu, args.output_sigma, 1, args.max_output)
        self.outcomes: list[Outcome] = []
        self.tasks: set[asyncio.Task] = set()

    async def run(self, duration_s: float) -> None:
        end = time.perf_counter() + duration_s
        while time.perf_counter() < end:
            prompt = self.rng.integers(0, self.args.vocab, int(self.inputs.sample(1, self.rng)[0]))
            o = Outcome(sent=time.perf_counter())
            self.outcomes.append(o)
            t = asyncio.create_task(
                one_request(
                    self.http,
                    self.args.url,
                    prompt.tolist(),
                    int(self.outputs.sample(1, self.rng)[0]),
                    o,
                )
            )
            self.tasks.add(t)
            t.add_done_callback(self.tasks.discard)
            await asyncio.sleep(self.rng.exponential(1.0 / self.args.rate))

    async def finish(self) -> dict[str, int]:
        if self.tasks:
            await asyncio.wait(self.tasks, timeout=self.args.request_timeout)
        counts: dict[str, int] = {}
        for o in self.outcomes:
            counts[o.status] = counts.get(o.status, 0) + 1
        return counts


async def metrics(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    return metrics_snapshot(await (await http.get(f"{url}/metrics")).text())


async def wait_idle(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    m = {}
    for _ in range(100):
        m = await metrics(http, url)
        if not m.get("nori:num_requests_running") and not m.get("nori:kv_cache_usage_perc"):
            break
        await asyncio.sleep(0.1)
    return m


async def engine_death(args, http, server_pid: int) -> dict:
    load = Load(args, http, seed=1)
    running = asyncio.create_task(load.run(args.phase_s * 3))
    await asyncio.sleep(args.phase_s)
    (core,) = children(server_pid)
    in_flight = len(load.tasks)
    killed = time.perf_counter()
    os.kill(core, signal.SIGKILL)
    healthy_at = None
    while healthy_at is None:
        await asyncio.sleep(0.05)
        try:
            async with http.get(f"{args.url}/health") as r:
                if r.status == 200:
                    healthy_at = time.perf_counter()
        except aiohttp.ClientError:
            pass
        if time.perf_counter() - killed > 600:
            break
    await running
    counts = await load.finish()
    m = await wait_idle(http, args.url)
    after = [o for o in load.outcomes if healthy_at is not None and o.sent > healthy_at]
    expected = {"ok", "error:engine_dead", "error:engine_unavailable"}
    return {
        "scenario": "engine death under load",
        "sent": len(load.outcomes),
        "counts": counts,
        "accounted": set(counts) <= expected and "pending" not in counts,
        "detail": (
            f"{in_flight} in flight at the kill; recovery {healthy_at - killed:.2f} s to "
            f"/health 200 (server: {m.get('nori:engine_recovery_seconds', float('nan')):.2f} s); "
            f"after it {sum(o.status == 'ok' for o in after)}/{len(after)} ok; restarts "
            f"{m.get('nori:engine_restarts_total', 0):.0f}"
            if healthy_at
            else "never recovered"
        ),
        "ok": healthy_at is not None
        and all(o.status == "ok" for o in after)
        and m.get("nori:engine_restarts_total") == 1,
    }


async def disconnect_storm(args, http) -> dict:
    before = await metrics(http, args.url)
    n = args.storm
    body = {"prompt": [1, 2, 3, 4], "max_tokens": args.max_output, "ignore_eos": True}
    body["stream"] = True

    async def leave_early(i: int) -> None:
        async with http.post(f"{args.url}/v1/completions", json=body) as r:
            chunks = 0
            async for _ in r.content.iter_any():
                chunks += 1
                if chunks >= 1 + i % 3:
                    break  # leaving the block closes the connection mid-stream

    for _ in range(args.storm_rounds):
        await asyncio.gather(*(leave_early(i) for i in range(n)), return_exceptions=True)
    m = await wait_idle(http, args.url)
    aborted = m.get("nori:request_success_total", 0) - before.get("nori:request_success_total", 0)
    probe = Outcome(sent=time.perf_counter())
    await one_request(http, args.url, [5, 6, 7], 8, probe)
    gone = n * args.storm_rounds
    return {
        "scenario": "client disconnect storm",
        "sent": gone,
        "counts": {"finished (server)": int(aborted)},
        "accounted": int(aborted) == gone,
        "detail": f"{args.storm_rounds} rounds of {n}; then idle: running "
        f"{m.get('nori:num_requests_running'):.0f}, KV {m.get('nori:kv_cache_usage_perc'):.2f}; "
        f"a new request {probe.status}",
        "ok": not m.get("nori:kv_cache_usage_perc") and probe.status == "ok",
    }


async def sigterm_under_load(args, http, proc) -> dict:
    load = Load(args, http, seed=2)
    running = asyncio.create_task(load.run(args.phase_s * 2))
    await asyncio.sleep(args.phase_s)
    sent_at = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    code = await asyncio.to_thread(proc.wait, 120)
    exited = time.perf_counter() - sent_at
    await running  # the load goes on after the exit: refused connections
    counts = await load.finish()
    # After the signal: finished, or a JSON 503 (or a refused connection once it exits).
    expected = {"ok", "error:engine_unavailable", "transport:ClientConnectorError"}
    return {
        "scenario": "SIGTERM under load",
        "sent": len(load.outcomes),
        "counts": counts,
        "accounted": set(counts) <= expected,
        "detail": f"exit code {code} after {exited:.1f} s (drain timeout {args.drain_timeout:g} s)",
        "ok": code == 0,
    }


async def run_all(args, proc) -> list[dict]:
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    async with aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
    ) as http:
        rows = [await engine_death(args, http, proc.pid)]
        rows.append(await disconnect_storm(args, http))
        rows.append(await sigterm_under_load(args, http, proc))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--serve", required=True, help="`nori-jax serve` arguments (an engine preset)")
    p.add_argument("--port", type=int, default=8126)
    p.add_argument("--rate", type=float, default=8.0, help="requests per second (Poisson)")
    p.add_argument("--phase-s", type=float, default=10.0, help="seconds of load per phase")
    p.add_argument("--drain-timeout", type=float, default=3.0)
    p.add_argument("--storm", type=int, default=64, help="clients per disconnect round")
    p.add_argument("--storm-rounds", type=int, default=3)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--input-mu", type=float, default=DEFAULT_INPUT.mu)
    p.add_argument("--input-sigma", type=float, default=DEFAULT_INPUT.sigma)
    p.add_argument("--max-input", type=int, default=DEFAULT_INPUT.max_len)
    p.add_argument("--output-mu", type=float, default=DEFAULT_OUTPUT.mu)
    p.add_argument("--output-sigma", type=float, default=DEFAULT_OUTPUT.sigma)
    p.add_argument("--max-output", type=int, default=DEFAULT_OUTPUT.max_len)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--log", type=Path, default=Path("fault_injection.server.log"))
    args = p.parse_args(argv)
    serve = f"{args.serve} --drain-timeout {args.drain_timeout}"
    proc = start_server(serve, args.port, args.log)
    args.url = f"http://127.0.0.1:{args.port}"
    try:
        rows = asyncio.run(run_all(args, proc))
    finally:
        if proc.poll() is None:
            proc.kill()
    print(f"| scenario | requests | outcomes | accounted | figures |\n|{'---|' * 5}")
    for r in rows:
        print(
            f"| {r['scenario']} | {r['sent']} | {r['counts']} | "
            f"{'yes' if r['accounted'] and r['ok'] else 'NO'} | {r['detail']} |"
        )
    return 0 if all(r["accounted"] and r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
