"""What a step buffer's way onto the device costs the launch, by route and size.

    python benchmarks/engine/stage_bench.py [--kib 670,170] [--calls 200] [--json F]
        [--routes device_put,no_transfer,...] [--update-mode skip_temp|always] [--hlo-dir D]

Each launch of the engine sends a fresh int32 step buffer from the host and copies it into the
runner's own device buffer (its address must not change: graph_launch_bench.py), then launches
the forward pass. This times that loop on the host (microseconds per step), with a chain of 400
small kernels standing in for the forward pass (its state donated, so its CUDA graph is never
updated) and the result of each step copied by the next step's staging program and read back
then, as the overlapped engine does:

  device_put     the runtime's transfer of the numpy buffer (placement.ReplicatedPut), then the
                 staging program: the engine's route
  pinned_host    the buffer put in pinned host memory (jax.device_put); the staging program
                 copies it in itself
  no_transfer    the staging program on a buffer already on the device: the floor of the route
  stage_only     no transfer, the staging program alone (no copy of the last result for the host):
                 a program that allocates no output
  no_d2h         no_transfer without starting the copy back at once (`copy_to_host_async`): the
                 host's read one step later copies it
  peek_ring      no transfer, the staging program copying the last result into one of three
                 buffers it takes donated (so it allocates no output) instead of a fresh one
  fold           no staging program: the forward pass takes the fresh buffer and copies it into
                 the donated state itself (a plain copy into the aliased output), and copies the
                 last step's result for the host. XLA puts those copies in the forward's CUDA
                 graph, which every launch then updates (`--hlo-dir` writes the optimized
                 modules)
  fold_dus       the same with the copies written as dynamic_update_slice and `+ 0` (fusions)
  direct         no staging program and no copy: the forward pass reads the fresh buffer and
                 writes a fresh output, whose copy to the host starts at once. Every launch moves
                 both, so this is the route for `--update-mode skip_profiled`, under which XLA
                 maps moved buffers at fixed addresses instead of updating the graph

for each buffer size of `--kib` (the h200-throughput engine's step buffer is 670 KiB at 1,024
sequences, 512 KiB of it the page table). Columns: put, stage, forward (host us each), and
the loop's host and wall time per step. `--update-mode always` runs under XLA's default
allocator instead of the VMM allocator that the engine's skip_temp mode brings; `skip_profiled`
under XLA's mode that maps buffers seen moving at fixed addresses (`--warmup` steps let it see
them; with jax 0.11.2 it still updates the graph, docs/benchmarks.md "Host costs"). The chain
is about 0.5 ms of device work on an H100, so the loop's totals are bound by the device; read
the parts. docs/benchmarks.md ("What the staging launch is made of") has a run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kib", default="670,170")
    p.add_argument("--routes", default="device_put,no_transfer,pinned_host")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--kernels", type=int, default=400)
    p.add_argument("--json", default=None)
    p.add_argument(
        "--update-mode", default="skip_temp", choices=["skip_temp", "skip_profiled", "always"]
    )
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--hlo-dir", default=None, help="write the fold routes' optimized HLO here")
    args = p.parse_args()

    from nori_jax.executor import xla_flags
    from nori_jax.executor.placement import ReplicatedPut

    flags = os.environ.get("XLA_FLAGS", "")
    if args.update_mode == "skip_profiled":  # XLA's, not an engine mode (docs/benchmarks.md)
        os.environ["XLA_FLAGS"] = xla_flags.with_update_value(flags, "SKIP_PROFILED")
    else:
        os.environ["XLA_FLAGS"] = xla_flags.with_update_mode(flags, args.update_mode)
    import jax
    import jax.numpy as jnp
    import numpy as np

    device = jax.devices()[0]
    on_device = jax.sharding.SingleDeviceSharding(device)
    routes = args.routes.split(",")
    pinned = None
    if "pinned_host" in routes:
        try:
            pinned = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
            jax.device_put(np.zeros(4, np.int32), pinned).block_until_ready()
        except Exception as e:  # a backend without that memory
            print(f"no pinned_host memory: {type(e).__name__}: {e}")
            routes.remove("pinned_host")

    h, n_w, k = 128, 30, args.kernels
    rng = np.random.default_rng(0)
    ws = [jnp.asarray(rng.standard_normal((h, h)) / h**0.5, jnp.bfloat16) for _ in range(n_w)]
    x0 = jnp.asarray(rng.standard_normal((16, h)), jnp.bfloat16)

    def forward(x, ws, out, state):
        x = x + 0.0 * out + state[:h].astype(x.dtype)  # reads the step buffer, as the engine's
        for i in range(k):
            x = jnp.tanh(x @ ws[i % n_w])
        return x

    fwd = jax.jit(forward, donate_argnums=2)
    # The staging program also copies the last step's result for the host (the engine's
    # stage+peek): the forward pass's own output is donated to the next step.
    stage = jax.jit(
        lambda state, fresh, last: (jax.lax.dynamic_update_slice(state, fresh, (0,)), last + 0),
        donate_argnums=0,
        out_shardings=on_device,
    )

    def time_steps(one, parts: dict, outputs) -> dict:
        """Three untimed steps (compile, record the graphs), then `--calls` timed ones: host us
        per step by part, and the loop's host and wall time per step (`outputs()`: what the
        last step leaves to wait on)."""
        for i in range(args.warmup):
            one(i, False)
        jax.block_until_ready(outputs())
        t0 = time.perf_counter()
        for i in range(args.calls):
            one(i, True)
        host = time.perf_counter() - t0
        jax.block_until_ready(outputs())
        wall = time.perf_counter() - t0
        per = 1e6 / args.calls
        totals = {"host": host * per, "wall": wall * per}
        return {name: v * per for name, v in parts.items()} | totals

    def folded(copy_in, copy_out):
        def program(x, ws, out, state, fresh):
            # The barrier keeps XLA from reading `fresh` where the chain reads the state (the
            # copy would otherwise be seen through), so one node reads the fresh buffer.
            state, last = jax.lax.optimization_barrier((copy_in(state, fresh), copy_out(out)))
            return forward(x, ws, out, state), state, last

        return jax.jit(program, donate_argnums=(2, 3), keep_unused=True, out_shardings=on_device)

    folds = {
        "fold": folded(lambda state, fresh: fresh, jnp.copy),
        "fold_dus": folded(
            lambda state, fresh: jax.lax.dynamic_update_slice(state, fresh, (0,)),
            lambda out: out + 0,
        ),
    }
    written = set()

    def run_fold(route: str, n: int) -> dict:
        prog = folds[route]
        state = jax.device_put(np.zeros(n, np.int32), on_device)
        host_bufs = [np.full(n, i, np.int32) for i in range(4)]
        put = ReplicatedPut((n,), np.int32, on_device)
        out = jnp.zeros_like(x0)
        if args.hlo_dir and (route, n) not in written:
            written.add((route, n))
            os.makedirs(args.hlo_dir, exist_ok=True)
            text = prog.lower(x0, ws, out, state, put(host_bufs[0])).compile().as_text()
            with open(os.path.join(args.hlo_dir, f"{route}_{n}.txt"), "w") as f:
                f.write(text)
        parts = {"put": 0.0, "stage": 0.0, "forward": 0.0}

        def one(i, timed):
            nonlocal state, out
            t0 = time.perf_counter()
            fresh = put(host_bufs[i % 4])
            t1 = time.perf_counter()
            out, state, last = prog(x0, ws, out, state, fresh)
            last.copy_to_host_async()
            t2 = time.perf_counter()
            np.asarray(last)
            if timed:
                parts["put"] += t1 - t0
                parts["forward"] += t2 - t1

        return time_steps(one, parts, lambda: out)

    stage_only = jax.jit(
        lambda state, fresh: jax.lax.dynamic_update_slice(state, fresh, (0,)),
        donate_argnums=0,
        out_shardings=on_device,
    )
    peek_ring = jax.jit(
        lambda state, fresh, last, slot: (
            jax.lax.dynamic_update_slice(state, fresh, (0,)),
            last + 0,  # into `slot`'s buffer: the output aliases it
        ),
        donate_argnums=(0, 3),
        keep_unused=True,
        out_shardings=on_device,
    )

    fwd_direct = jax.jit(lambda x, ws, state: forward(x, ws, x, state))

    def run_direct(n: int) -> dict:
        host_bufs = [np.full(n, i, np.int32) for i in range(4)]
        put = ReplicatedPut((n,), np.int32, on_device)
        out = last = None
        parts = {"put": 0.0, "stage": 0.0, "forward": 0.0}

        def one(i, timed):
            nonlocal out, last
            t0 = time.perf_counter()
            fresh = put(host_bufs[i % 4])
            t1 = time.perf_counter()
            out = fwd_direct(x0, ws, fresh)
            out.copy_to_host_async()
            t2 = time.perf_counter()
            if last is not None:
                np.asarray(last)  # the step before, read back one step late
            last = out
            if timed:
                parts["put"] += t1 - t0
                parts["forward"] += t2 - t1

        return time_steps(one, parts, lambda: out)

    def run(route: str, n: int) -> dict:
        if route == "direct":
            return run_direct(n)
        if route in folds:
            return run_fold(route, n)
        if route in ("stage_only", "peek_ring"):
            return run_resident(route, n)
        state = jax.device_put(np.zeros(n, np.int32), on_device)
        host_bufs = [np.full(n, i, np.int32) for i in range(4)]
        resident = jax.device_put(host_bufs[0], on_device)
        if route == "pinned_host":
            put = lambda x: jax.device_put(x, pinned)  # noqa: E731
        else:
            put = ReplicatedPut((n,), np.int32, on_device)
        if route == "pinned_host":
            s = jax.jit(
                lambda state, fresh, last: (
                    jax.lax.dynamic_update_slice(state, jax.device_put(fresh, on_device), (0,)),
                    last + 0,
                ),
                donate_argnums=0,
                out_shardings=on_device,
            )
        else:
            s = stage
        out = jnp.zeros_like(x0)
        parts = {"put": 0.0, "stage": 0.0, "forward": 0.0}

        def one(i, timed):
            nonlocal state, out
            t0 = time.perf_counter()
            fresh = resident if route in ("no_transfer", "no_d2h") else put(host_bufs[i % 4])
            t1 = time.perf_counter()
            state, last = s(state, fresh, out)
            if route != "no_d2h":
                last.copy_to_host_async()
            t2 = time.perf_counter()
            out = fwd(x0, ws, out, state)
            t3 = time.perf_counter()
            np.asarray(last)  # the step before, read back one step late
            if timed:
                parts["put"] += t1 - t0
                parts["stage"] += t2 - t1
                parts["forward"] += t3 - t2

        return time_steps(one, parts, lambda: out)

    def run_resident(route: str, n: int) -> dict:
        state = jax.device_put(np.zeros(n, np.int32), on_device)
        fresh = jax.device_put(np.ones(n, np.int32), on_device)
        out = jnp.zeros_like(x0)
        ring = [jnp.zeros_like(x0) for _ in range(3)]
        parts = {"put": 0.0, "stage": 0.0, "forward": 0.0}

        def one(i, timed):
            nonlocal state, out
            t1 = time.perf_counter()
            last = None
            if route == "stage_only":
                state = stage_only(state, fresh)
            else:
                state, last = peek_ring(state, fresh, out, ring[i % 3])
                ring[i % 3] = last
                last.copy_to_host_async()
            t2 = time.perf_counter()
            out = fwd(x0, ws, out, state)
            t3 = time.perf_counter()
            if last is not None:
                np.asarray(last)
            if timed:
                parts["stage"] += t2 - t1
                parts["forward"] += t3 - t2

        return time_steps(one, parts, lambda: out)

    sizes = [int(x) for x in args.kib.split(",")]
    results: dict[str, list[dict]] = {}
    for _ in range(args.rounds):
        for kib in sizes:
            for route in routes:
                results.setdefault(f"{route} {kib} KiB", []).append(run(route, kib * 256))
    print(
        f"{device.device_kind}, forward of {k} kernels, {args.update_mode}: host us per step "
        "(median of rounds)"
    )
    print(f"  {'route':24s} {'put':>7s} {'stage':>7s} {'forward':>8s} {'host':>7s} {'wall':>7s}")
    summary = {}
    for name, rs in results.items():
        med = {key: statistics.median(r[key] for r in rs) for key in rs[0]}
        summary[name] = {"median": med, "runs": rs}
        print(
            f"  {name:24s} {med['put']:7.1f} {med['stage']:7.1f} {med['forward']:8.1f} "
            f"{med['host']:7.1f} {med['wall']:7.1f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"kernels": k, "results": summary}, f, indent=1)


if __name__ == "__main__":
    main()
