"""What moving the step buffer to the device costs the host, by its size (GPU).

    python benchmarks/engine/step_buffer_transfer.py [--sizes-kib 8,256,761,3043] [--calls 200]

The runner sends each step's metadata as one int32 numpy buffer and copies it into the buffer the
programs take donated (`stage`, a one-kernel program). This times, for buffers of the given sizes
(medians over `--calls`, after a warm-up), `jax.device_put`, the runner's own transfer
(`placement.ReplicatedPut`, the runtime's batched transfer without device_put's per-call work)
and the copy program after it: the 761 KiB row is the engine's buffer at 1,024 sequences x 128
pages x 8,192 tokens, whose page table (512 KiB) a step of few rows barely uses.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np

from nori_jax.executor.placement import ReplicatedPut


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-kib", default="8,256,761,3043")
    p.add_argument("--calls", type=int, default=200)
    args = p.parse_args()
    dev = jax.devices()[0]
    sharding = jax.sharding.SingleDeviceSharding(dev)
    stage = jax.jit(lambda state, fresh: fresh, donate_argnums=(0,))
    print(f"{dev.device_kind}: host us per call (medians of {args.calls})")
    for kib in (int(v) for v in args.sizes_kib.split(",")):
        host = np.arange(kib * 256, dtype=np.int32)
        runner_put = ReplicatedPut(host.shape, host.dtype, sharding)
        state = jax.device_put(host, dev)
        for _ in range(5):  # warm-up: both transfers, the copy program compiled
            state = stage(state, jax.device_put(host, dev))
            state = stage(state, runner_put(host))
        jax.block_until_ready(state)
        times: dict[str, list[float]] = {"device_put": [], "runner put": [], "copy program": []}
        for _ in range(args.calls):
            t0 = time.perf_counter()
            jax.device_put(host, dev)
            t1 = time.perf_counter()
            fresh = runner_put(host)
            t2 = time.perf_counter()
            state = stage(state, fresh)
            times["copy program"].append(time.perf_counter() - t2)
            times["runner put"].append(t2 - t1)
            times["device_put"].append(t1 - t0)
        jax.block_until_ready(state)
        cells = "  ".join(f"{k} {1e6 * statistics.median(v):7.1f}" for k, v in times.items())
        print(f"  {kib:6d} KiB  {cells}")


if __name__ == "__main__":
    main()
