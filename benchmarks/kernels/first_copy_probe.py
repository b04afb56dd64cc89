"""What a Mosaic GPU kernel costs before its work starts: the floor under a short prefill chunk.

On 512-token prefill chunks the attention kernel is 2-2.6 us behind cuDNN's flash attention, a
fixed amount per call (docs/benchmarks.md, "The first copies of a short chunk"), and its first
K block lands 2.7-4.1 us after the kernel starts. This probe times kernels that do nothing but
the attention kernel's start-up steps, each on one CTA per SM, so that the fixed cost can be
split into what any kernel of this toolchain pays and what the attention kernel adds:

- `xla_add`: XLA's own kernel adding 1 to a [CTAs * 64, 64] bf16 array (a CUDA kernel's floor);
- `empty`: a Mosaic GPU kernel with one warpgroup that does nothing;
- `copy`: one warpgroup TMA-loads a [64, 64] bf16 tile (swizzled, as wgmma reads it), waits,
  and TMA-stores it: one round trip through global memory;
- `ws_copy`: the attention kernel's shape: two compute warpgroups and a producer warpgroup, the
  register re-allocation, the producer's copy and the compute warpgroups' wait and store;
- `ws_chain1`, `ws_chain3`, `ws_chain6`: as `ws_copy`, with the tile's row found through 1, 3 or 6
  dependent scalar loads from global memory first (the attention kernel's first copies wait on
  such a chain: item count -> part -> page);
- `ws_barriers`: as `ws_copy`, with as many barriers as the attention kernel allocates (24);
- `ws_32copies`: as `ws_copy`, the tile copied in 32 pieces of 2 rows into an unswizzled tile
  (one thread issues them, as the attention kernel issues a tile's per-token Q copies into its
  unswizzled Q slot).

Each variant's device time per call comes from a profiler trace of `--reps` calls (the
largest kernel's, and any other kernel's the call runs).

    PYTHONPATH=. python benchmarks/kernels/first_copy_probe.py [--reps 200] [--out DIR]

`--dry` runs every variant once in interpret mode (CPU) and checks its output.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from trace_events import largest_kernel_per_call, traced_kernel_totals  # noqa: E402

ROWS, D = 64, 64
CHAIN_MAX = 8  # rows of the index table the chain variants walk
TILE = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))  # bf16 rows of 128 bytes


def _kernel(body, num_ctas, *, threads, scratch, interpret):
    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((num_ctas * ROWS, D), jnp.bfloat16),
        scratch_types=scratch,
        grid=(num_ctas,),
        grid_names=("cta",),
        num_threads=threads,
        thread_name="wg" if threads else None,
        interpret=interpret,
    )


def empty(num_ctas, interpret):
    def body(x_ref, idx_ref, out_ref):
        del x_ref, idx_ref, out_ref

    return _kernel(body, num_ctas, threads=None, scratch=[], interpret=interpret)


def copy(num_ctas, interpret):
    def body(x_ref, idx_ref, out_ref, tile, full):
        del idx_ref
        rows = pl.ds(lax.axis_index("cta") * ROWS, ROWS)
        plgpu.copy_gmem_to_smem(x_ref.at[rows], tile, full)
        plgpu.barrier_wait(full)
        plgpu.copy_smem_to_gmem(tile, out_ref.at[rows])
        plgpu.wait_smem_to_gmem(0)

    scratch = [plgpu.SMEM((ROWS, D), jnp.bfloat16, transforms=TILE), plgpu.Barrier(num_arrivals=1)]
    return _kernel(body, num_ctas, threads=None, scratch=scratch, interpret=interpret)


def warp_specialised(
    num_ctas, interpret, *, chain: int = 0, extra_barriers: int = 0, copies: int = 1
):
    """Two compute warpgroups and a producer, as the attention kernel: the producer copies each
    compute warpgroup's half of the tile (in `copies` pieces); each waits for it and stores it."""
    half = ROWS // 2
    piece = half // copies

    def body(x_ref, idx_ref, out_ref, tile, full, *unused):
        del unused
        wg = lax.axis_index("wg")
        cta = lax.axis_index("cta")

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            plgpu.barrier_wait(full.at[wg])
            rows = pl.ds(cta * ROWS + wg * half, half)
            plgpu.copy_smem_to_gmem(tile.at[pl.ds(wg * half, half)], out_ref.at[rows])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 2)
        def _produce():
            plgpu.set_max_registers(40, action="decrease")
            row = cta
            for k in range(chain):  # dependent loads, as the kernel's item -> part -> page
                row = idx_ref[k, row]  # one row of idx per load: each a line of its own
            for w in range(2):
                for c in range(copies):
                    rows = pl.ds(w * half + c * piece, piece)
                    src = x_ref.at[pl.ds(row * ROWS + w * half + c * piece, piece)]
                    plgpu.copy_gmem_to_smem(src, tile.at[rows], full.at[w])

    scratch = [  # pieces of a few rows go to an unswizzled tile, as the kernel's Q rows do
        plgpu.SMEM((ROWS, D), jnp.bfloat16, transforms=TILE if copies == 1 else ()),
        plgpu.Barrier(num_arrivals=copies, num_barriers=2),
    ] + [plgpu.Barrier(num_arrivals=1, num_barriers=2)] * (extra_barriers // 2)
    return _kernel(body, num_ctas, threads=3, scratch=scratch, interpret=interpret)


VARIANTS = {
    "empty": empty,
    "copy": copy,
    "ws_copy": warp_specialised,
    "ws_chain1": functools.partial(warp_specialised, chain=1),
    "ws_chain3": functools.partial(warp_specialised, chain=3),
    "ws_chain6": functools.partial(warp_specialised, chain=6),
    "ws_barriers": functools.partial(warp_specialised, extra_barriers=22),
    "ws_32copies": functools.partial(warp_specialised, copies=16),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--dry", action="store_true", help="interpret mode on the CPU, 2 CTAs")
    args = ap.parse_args()
    dev = jax.devices()[0]
    num_ctas = 2 if args.dry else (getattr(dev, "core_count", None) or 132)
    x = jax.random.normal(jax.random.key(0), (num_ctas * ROWS, D), jnp.bfloat16)
    # idx[k, c] == c: every chain lands on the CTA's own rows
    idx = jnp.tile(jnp.arange(num_ctas, dtype=jnp.int32), (CHAIN_MAX, 1))
    rows = []
    fns = {"xla_add": jax.jit(lambda x, idx: x + jnp.bfloat16(1))}
    for name, make in VARIANTS.items():
        interpret = plgpu.InterpretGPUParams() if args.dry else False
        fns[name] = jax.jit(make(num_ctas, interpret=interpret))
    xs = [] if args.dry else [x + i for i in range(args.reps)]  # fresh inputs: not in L2
    for name, fn in fns.items():
        out = jax.block_until_ready(fn(x, idx))
        want = x + jnp.bfloat16(1) if name == "xla_add" else x
        ok = name == "empty" or bool(np.array_equal(np.asarray(out), np.asarray(want)))
        row = dict(variant=name, correct=ok, device=str(dev.device_kind))
        if not args.dry:
            calls = functools.partial(lambda f: jax.block_until_ready([f(v, idx) for v in xs]), fn)
            calls()
            top, kernel_us, others = largest_kernel_per_call(traced_kernel_totals(calls), args.reps)
            row.update(
                kernel=top[:60],
                kernel_us=kernel_us,
                others_us={k[:60]: us for k, us in others.items()},
            )
        rows.append(row)
        print(json.dumps(row), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "first_copy_probe.json"), "w") as f:
        json.dump(rows, f)
    print(f"\n{'variant':12s} {'correct':8s} {'kernel us':>10s}")
    for r in rows:
        print(f"{r['variant']:12s} {r['correct']!s:8s} {r.get('kernel_us', float('nan')):10.2f}")


if __name__ == "__main__":
    main()
