"""The API server process alone: how much host CPU one streamed token costs it.

    python benchmarks/engine/api_server_bench.py [--num-prompts 1000] [--concurrency 256] \
        [--input-len 16] [--output-len 200] [--runs 2] [-- SERVE_FLAGS ...]

Starts `nori-jax serve` (engine core in its own process, as by default) with the engine-core
program replaced by `fake_core.py`, which streams one token per running request every 5 ms with no
model. Then `nori-jax bench serve` sends `--num-prompts` streaming /v1/completions requests, at
most `--concurrency` at once, and the script reads from /proc how many CPU seconds the API server
processes (all their threads; several with `-- --api-server-count N`) and the fake core spent
during the load. The figure: API-server CPU microseconds per streamed output token, which bounds
the served throughput of one API server process at about 1e6 / (that figure) tokens per second, and
per request. With `--output-len 1` and the benchmark workload's mean prompt (`--input-len 680`,
token ids) the per-request figure is what a request costs its API server besides its tokens: parsing
and validating the body, the way to the core, the response's start and end.
Flags after `--` go to `nori-jax serve`. Needs the bench extra.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def children(pid: int) -> dict[int, str]:
    """Child process ids of `pid` and their command lines."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as f:
            for child in f.read().split():
                with open(f"/proc/{child}/cmdline", "rb") as c:
                    out[int(child)] = c.read().replace(b"\0", b" ").decode()
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, max_seqs: int, serve_flags: list[str], log) -> subprocess.Popen:
    code = (
        "import sys, nori_jax.core_client as c\n"
        f"c.CORE_PROGRAM = [{os.path.join(HERE, 'fake_core.py')!r}]\n"
        "from nori_jax.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    argv = ["serve", "--config", "tiny-cpu", "--max-num-seqs", str(max_seqs), "--port", str(port)]
    argv += ["--max-num-batched-tokens", str(max(128, max_seqs))]  # a step holds every sequence
    argv += ["--no-access-log", *serve_flags]
    proc = subprocess.Popen([sys.executable, "-c", code, *argv], stdout=log, stderr=log)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.3)
    raise RuntimeError("the server was not healthy within 120 s")


def run_load(port: int, args, out_json: str) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "nori_jax.bench",
        "serve",
        "--base-url",
        f"http://127.0.0.1:{port}",
    ]
    cmd += ["--dataset", "fixed", "--input-len", str(args.input_len)]
    cmd += ["--output-len", str(args.output_len)]
    cmd += ["--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.concurrency)]
    cmd += ["--request-rate", "inf", "--ignore-eos", "--prompt-format", "token-ids"]
    cmd += ["--disable-tqdm", "--warmup-requests", "0", "--result-json", out_json]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode:
        sys.exit(f"bench serve failed ({done.returncode}):\n{done.stdout[-3000:]}")
    with open(out_json) as f:
        return json.load(f)


def main() -> None:
    argv = sys.argv[1:]
    serve_flags = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--input-len", type=int, default=16, help="prompt tokens (sent as token ids)")
    p.add_argument("--output-len", type=int, default=200)
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp, open(os.path.join(tmp, "serve.log"), "w") as log:
        port = free_port()
        server = start_server(port, args.concurrency, serve_flags, log)
        try:
            time.sleep(2)  # API servers 1.. (--api-server-count) come up after the first
            kids = children(server.pid)
            core = next(pid for pid, cmd in kids.items() if "fake_core" in cmd)
            apis = [server.pid] + [pid for pid, cmd in kids.items() if "serve.api_servers" in cmd]

            def api_cpu() -> float:
                return sum(cpu_seconds(p) for p in apis)

            for run in range(args.runs):
                s0, c0, t0 = api_cpu(), cpu_seconds(core), time.perf_counter()
                result = run_load(port, args, os.path.join(tmp, f"r{run}.json"))
                wall = time.perf_counter() - t0
                s1, c1 = api_cpu(), cpu_seconds(core)
                tokens = result["total_output_tokens"] if "total_output_tokens" in result else None
                if tokens is None:
                    tokens = args.num_prompts * args.output_len
                rows.append(
                    {
                        "run": run,
                        "serve_flags": " ".join(serve_flags),
                        "output_tokens": tokens,
                        "failed": result.get("failed", result.get("num_failed")),
                        "wall_s": wall,
                        "output_tok_s": tokens / wall,
                        "api_server_cpu_s": s1 - s0,
                        "api_server_us_per_token": (s1 - s0) / tokens * 1e6,
                        "api_server_us_per_request": (s1 - s0) / args.num_prompts * 1e6,
                        "fake_core_cpu_s": c1 - c0,
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
        finally:
            server.terminate()
            server.wait(30)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print("\n| run | output tok/s | API server CPU s | us per token | us per request", end="")
    print(" | fake core CPU s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['run']} | {r['output_tok_s']:,.0f} | {r['api_server_cpu_s']:.1f} | "
            f"{r['api_server_us_per_token']:.1f} | {r['api_server_us_per_request']:.0f} | "
            f"{r['fake_core_cpu_s']:.1f} |"
        )


if __name__ == "__main__":
    main()
