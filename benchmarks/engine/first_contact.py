"""A new user's first commands, timed: the README's Python example, `nori-jax generate` and
`nori-jax chat` (one question on a scripted stdin), each in a fresh process.

Cold: an empty compilation cache and an empty parameter cache (a first install: the GGUF is
converted and every bucket compiled). Warm: the same command again on the caches the cold run
filled. Each figure is the wall time of the whole process, start to exit, and in brackets its CPU
time (user + system, children included): on a shared machine the wall time depends on the load
(printed), the CPU time much less; on an idle 2-core machine the wall time lies between half the CPU
time and all of it.

    python benchmarks/engine/first_contact.py [--repeats 2] [--keep-params]

Prints a Markdown table (the README's figures come from it).
"""

from __future__ import annotations

import argparse
import os
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from readme_snippets import readme_command, readme_python_example  # noqa: E402

CHAT_INPUT = "What is the capital of France?\n"


def commands() -> dict[str, tuple[list[str], str | None]]:
    return {
        "README Python example": ([sys.executable, "-c", readme_python_example()], None),
        shlex.join(["nori-jax", *readme_command("generate")[1:]]): (
            readme_command("generate"),
            None,
        ),
        "nori-jax chat (one question)": (readme_command("chat"), CHAT_INPUT),
    }


def timed(argv: list[str], stdin: str | None, env: dict[str, str]) -> tuple[float, float, str]:
    """(wall seconds, CPU seconds, stdout) of one run."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    r = subprocess.run(argv, input=stdin, env=env, capture_output=True, text=True, timeout=1800)
    elapsed = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    if r.returncode:
        raise SystemExit(f"{argv[:3]} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return elapsed, cpu, r.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=1, help="cold + warm pairs per command")
    ap.add_argument(
        "--keep-params",
        action="store_true",
        help="cold runs keep the user's parameter cache (only the compilation cache is empty)",
    )
    args = ap.parse_args()
    load_before = os.getloadavg()[0]
    rows = []
    for name, (argv, stdin) in commands().items():
        cold, warm = [], []
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory(prefix="nori-first-contact-") as tmp:
                env = dict(os.environ, NORI_JAX_CACHE_DIR=f"{tmp}/xla")
                if not args.keep_params:
                    env["NORI_JAX_PARAM_CACHE"] = f"{tmp}/params"
                *t, out = timed(argv, stdin, env)
                cold.append(t)
                warm.append(timed(argv, stdin, env)[:2])
                shutil.rmtree(tmp, ignore_errors=True)
            lines = [line.lstrip("> ").strip() for line in out.splitlines()]
            answer = next((x for x in lines if x and not x.startswith("Type a message")), "")
        rows.append((name, cold, warm, answer))
        print(f"{name}: cold {cold}, warm {warm}", file=sys.stderr)
    caches = "compilation cache" if args.keep_params else "compilation and parameter caches"
    print(
        f"\n{os.cpu_count()} CPUs, load average {load_before:.1f} at the start and "
        f"{os.getloadavg()[0]:.1f} at the end; cold = empty {caches}\n"
    )
    print("| command | cold: wall (CPU) s | warm: wall (CPU) s | first line of output |")
    print("|---|---|---|---|")
    for name, cold, warm, answer in rows:
        fmt = lambda xs: " / ".join(f"{w:.0f} ({c:.0f})" for w, c in xs)  # noqa: E731
        print(f"| `{name}` | {fmt(cold)} | {fmt(warm)} | {answer[:60]} |")


if __name__ == "__main__":
    main()
