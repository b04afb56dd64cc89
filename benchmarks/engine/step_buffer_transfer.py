"""What moving the step buffer to the device costs the host, by its size (GPU).

    python benchmarks/engine/step_buffer_transfer.py [--sizes-kib 8,256,761,3043] [--calls 200]

The runner sends each step's metadata as one int32 numpy buffer (`jax.device_put`) and copies it
into the buffer the programs take donated (`stage`, a one-kernel program). This times both host
calls for buffers of the given sizes (medians over `--calls`, after a warm-up): the 761 KiB row is
the engine's buffer at 1,024 sequences x 128 pages x 8,192 tokens, whose page table (512 KiB) a
step of few rows barely uses.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-kib", default="8,256,761,3043")
    p.add_argument("--calls", type=int, default=200)
    args = p.parse_args()
    dev = jax.devices()[0]
    stage = jax.jit(lambda state, fresh: fresh, donate_argnums=(0,))
    print(f"{dev.device_kind}: host us per call (medians of {args.calls})")
    for kib in (int(v) for v in args.sizes_kib.split(",")):
        host = np.arange(kib * 256, dtype=np.int32)
        state = jax.device_put(host, dev)
        for _ in range(5):
            state = stage(state, jax.device_put(host, dev))
        jax.block_until_ready(state)
        put, copy = [], []
        for _ in range(args.calls):
            t0 = time.perf_counter()
            fresh = jax.device_put(host, dev)
            t1 = time.perf_counter()
            state = stage(state, fresh)
            copy.append(time.perf_counter() - t1)
            put.append(t1 - t0)
        jax.block_until_ready(state)
        print(
            f"  {kib:6d} KiB  device_put {1e6 * statistics.median(put):7.1f}  "
            f"copy program {1e6 * statistics.median(copy):7.1f}"
        )


if __name__ == "__main__":
    main()
