"""Forms of the step's KV write (an XLA scatter into the pages), timed on the GPU; table last.

    PYTHONPATH=. python benchmarks/kernels/kv_write_bench.py --out DIR

Each form is jitted with the pages donated (in place, as in the engine's step) and called
`--reps` times in a row under the JAX profiler; the row reports every device kernel's time per
call (a form that copies the pool shows it here) and checks the written pages against
`write_kv_reference` (pages 1 on; page 0 takes the padding tokens' colliding writes).

Forms: "5d" kv_layout.write_kv_reference (bf16 elements, update windows [Hkv, 2, D]); "5d_u32"
kv_layout.write_kv_packed (the same scatter on each pair of bf16 values bitcast to one u32 word,
what the engine runs); "rows" and "rows_u32": the pages viewed as [P * Hkv * 2 * PS, D] rows, one
contiguous row per (token, kv head, K or V), in bf16 or in words (measured no faster; not in the
library, since merging the kv-head axis into the rows would defeat its tensor-parallel sharding).
`--fp8`: e4m3 pages of 64 tokens, whose V is stored transposed (kv_layout.py): "5d" writes K's
rows and V's columns value by value, "5d_u32" K's rows as 32-bit words and V's columns value by
value (what the engine runs). "_unique": the same scatter with `unique_indices=True`.
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

from pallas_kernels.kv_layout import write_kv_packed, write_kv_reference

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from trace_events import traced_kernel_totals  # noqa: E402


def _as_u32(x):  # [..., D] 16-bit -> u32[..., D / 2], a bitcast
    return lax.bitcast_convert_type(x.reshape(*x.shape[:-1], x.shape[-1] // 2, 2), jnp.uint32)


def _from_u32(x, dtype):
    y = lax.bitcast_convert_type(x, dtype)  # [..., D / 2, 2]
    return y.reshape(*y.shape[:-2], -1)


def write_rows(kv_pages, k, v, slots):
    """The pages as [P * Hkv * 2 * PS, D] rows: one row id per (token, kv head, K or V)."""
    _, hkv, _, ps, d = kv_pages.shape
    page, offset = (slots // ps)[:, None, None], (slots % ps)[:, None, None]
    head = jnp.arange(hkv)[None, :, None]
    kind = jnp.arange(2)[None, None, :]
    rows = ((page * hkv + head) * 2 + kind) * ps + offset  # [T, Hkv, 2]
    kv = jnp.stack([k, v], axis=2).astype(kv_pages.dtype).reshape(-1, d)
    flat = kv_pages.reshape(-1, d).at[rows.reshape(-1)].set(kv, mode="promise_in_bounds")
    return flat.reshape(kv_pages.shape)


def rows_u32(kv_pages, k, v, slots):
    out = write_rows(_as_u32(kv_pages), _as_u32(k), _as_u32(v), slots)
    return _from_u32(out, kv_pages.dtype)


FORMS = {
    "5d": write_kv_reference,
    "rows": write_rows,
    "5d_u32": write_kv_packed,
    "rows_u32": rows_u32,
    # the same scatters told their slots are distinct (kv_layout.write_kv_reference)
    "5d_unique": functools.partial(write_kv_reference, unique_indices=True),
    "5d_u32_unique": functools.partial(write_kv_packed, unique_indices=True),
}


def case(rng, *, num_pages, hkv, d, page_size, num_tokens, num_valid, decode, dtype):
    shape = (num_pages, hkv, 2, page_size, d)
    pages = jax.random.normal(jax.random.key(0), shape, jnp.bfloat16).astype(dtype)
    k, v = (
        jax.random.normal(jax.random.key(i), (num_tokens, hkv, d), jnp.bfloat16) for i in (1, 2)
    )
    slots = np.zeros(num_tokens, np.int32)  # padding tokens: the null page
    if decode:  # one token per sequence: anywhere
        slots[:num_valid] = rng.permutation(np.arange(page_size, num_pages * page_size))[:num_valid]
    else:  # one sequence's chunk: page after page (in random pages), slot after slot
        own = rng.permutation(np.arange(1, num_pages))[: -(-num_valid // page_size)]
        i = np.arange(num_valid)
        slots[:num_valid] = own[i // page_size] * page_size + i % page_size
    return pages, k, v, jnp.asarray(slots)


def time_form(name, pages, k, v, slots, reps):
    step = jax.jit(FORMS[name], donate_argnums=0)
    expected = np.asarray(write_kv_reference(pages, k, v, slots)[1:])
    pages = step(jnp.copy(pages), k, v, slots)
    ok = bool(np.array_equal(np.asarray(pages[1:]).view(np.uint8), expected.view(np.uint8)))
    for _ in range(2):
        pages = step(pages, k, v, slots)
    jax.block_until_ready(pages)

    def run():
        nonlocal pages
        for _ in range(reps):
            pages = step(pages, k, v, slots)
        jax.block_until_ready(pages)

    totals = traced_kernel_totals(run)  # ns over `reps` calls
    us = sum(totals.values()) / reps / 1e3
    top = {kname[:50]: ns / reps / 1e3 for kname, ns in totals.most_common(4)}
    return dict(form=name, exact=ok, us=us, kernels=top)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--dry", action="store_true", help="tiny shapes (CPU dry runs)")
    ap.add_argument(
        "--fp8",
        action="store_true",
        help="e4m3 pages of 64 tokens (V^T value by value; K rows by value in 5d, as words in "
        "5d_u32); only the 5d forms",
    )
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    s = 64 if args.dry else 1
    ps = 64 if args.fp8 else 16
    dtype = jnp.float8_e4m3fn if args.fp8 else jnp.bfloat16
    forms = ["5d", "5d_u32", "5d_unique", "5d_u32_unique"] if args.fp8 else list(FORMS)
    cases = {  # name: (hkv, d, page_size, tokens, valid tokens, decode)
        "decode B=256, 8 kv heads x 128": (8, 128, ps, 256 // s, 250 // s, True),
        "prefill 8192, 8 kv heads x 128": (8, 128, ps, 8192 // s, 8190 // s, False),
        "prefill 2048, 8 kv heads x 64": (8, 64, ps, 2048 // s, 2040 // s, False),
        "prefill 8192, 3 kv heads x 64": (3, 64, ps, 8192 // s, 8190 // s, False),
    }
    rows = []
    for cname, (hkv, d, ps, t, n, decode) in cases.items():
        num_pages = 1 + 2 * 8192 * 8 // ps // s  # two chunks of 8,192 (8 kv heads x 128)
        arrays = case(rng, num_pages=num_pages, hkv=hkv, d=d, page_size=ps, num_tokens=t,
                      num_valid=n, decode=decode, dtype=dtype)  # fmt: skip
        mb = 2 * jnp.dtype(dtype).itemsize * n * hkv * d / 1e6
        for form in forms:
            try:
                row = dict(case=cname, mb=mb, **time_form(form, *arrays, args.reps))
            except Exception as e:  # noqa: BLE001
                row = dict(case=cname, form=form, error=f"{type(e).__name__}: {str(e)[:300]}")
            print(json.dumps(row), flush=True)
            rows.append(row)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "kv_write_bench.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(f"\n{'case':34s} {'form':13s} {'us/call':>8s} {'GB/s':>6s} exact  kernels (us)")
    for r in rows:
        if "error" in r:
            print(f"{r['case']:34s} {r['form']:13s} ERROR {r['error'][:80]}")
            continue
        gbs = r["mb"] * 1e3 / r["us"] if r["us"] else 0
        ks = ", ".join(f"{k} {v:.1f}" for k, v in r["kernels"].items())
        print(f"{r['case']:34s} {r['form']:13s} {r['us']:8.1f} {gbs:6.0f} {r['exact']!s:5s}  {ks}")


if __name__ == "__main__":
    main()
