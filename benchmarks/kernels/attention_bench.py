"""Ragged paged attention on the GPU: build, check against the jnp reference, time; table last.

    PYTHONPATH=. python benchmarks/kernels/attention_bench.py --phase smoke|decode|prefill --out DIR

Ceilings (copy bandwidth, bf16 matmul rate) are measured in the same run. Decode reports KV bytes
read per second against the copy bandwidth (bytes read + written of a large device copy); prefill
reports causal attention FLOP/s (4 * D * Hq per visible (query, key) pair) against the matmul rate.
JAX's own Pallas (Triton) `paged_attention` runs on the same decode shapes in its own page layout;
with `--cudnn-baseline`, cuDNN's flash attention runs on the same prefill work (contiguous K/V).

Every timed call is checked first: rows of the first (up to) 8 sequences against the reference, as
relative L2 error. Times are device times per call: one compiled program dispatched `--reps`
times back to back on different page tables (so repeated calls do not hit in L2), median of
`--trials` such rounds (see back_to_back: calls shorter than their dispatch are upper bounds).
With `--device-times`, prefill rows also trace `--reps` calls with the JAX profiler and report
the attention kernel's own device time per call (`kernel_ms`, its TFLOP/s `kernel_tflops`) and
that of the XLA ops around it (`others_ms`: head-major transposes, tile metadata, masking).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time
import traceback
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import attention_step
from pallas_kernels.ragged_paged_attention.pallas_attention import ragged_paged_attention_pallas
from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention_reference
from pallas_kernels.ragged_paged_attention.tuning import (
    SMEM_BYTES,
    SMEM_SLACK,
    TuningConfig,
    default_tuning,
)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from trace_events import largest_kernel_per_call, traced_kernel_totals  # noqa: E402

LAYOUTS = {"32q/8kv/128": (32, 8, 128), "32q/8kv/64": (32, 8, 64), "9q/3kv/64": (9, 3, 64)}
LOG: list[dict] = []
DRY = False  # --dry: CPU dry run of this script (interpret mode, tiny ceilings, no rotations)


def log(**row):
    LOG.append(row)
    print(json.dumps(row), flush=True)


def timed(fn, trials: int) -> float:
    """Median wall time of fn() (which blocks), after one warm-up call."""
    fn()
    ts = []
    for _ in range(trials):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    if not np.all(np.isfinite(out)):
        return float("inf")
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


# ----------------------------------------------------------------------------------------------
# Ceilings


def back_to_back(fn, xs: list, trials: int) -> float:
    """Time per call of fn(x), called on each x of xs back to back, median over trials.

    fn must be jitted with every array an argument (a closed-over array would be baked into the
    program as a constant: slow to compile, and not the program an engine runs). Calls are
    dispatched without waiting: while a call takes longer on the device than its dispatch on the
    host (~10-30 us), this is the device time per call; below that it is an upper bound
    (dispatch-bound), which is what short calls get in a real step too. Cycling through xs
    (different page tables) keeps the KV out of L2 between calls.
    """
    for _ in range(2):
        jax.block_until_ready([fn(x) for x in xs])
    return timed(lambda: jax.block_until_ready([fn(x) for x in xs]), trials) / len(xs)


def device_times(fn, xs: list) -> dict:
    """fn(x) for each x of xs under the JAX profiler: per call, the device time of the kernel
    with the most total time (the attention kernel, in every case this script times) and of the
    rest, in ms."""
    jax.block_until_ready([fn(x) for x in xs])
    total = traced_kernel_totals(lambda: jax.block_until_ready([fn(x) for x in xs]))
    if not total:
        return dict(device_times_error="no GPU events in the trace")
    top, kernel_us, others = largest_kernel_per_call(total, len(xs))
    return dict(
        kernel_name=top[:80],
        kernel_ms=kernel_us / 1e3,
        others_ms=sum(others.values()) / 1e3,
        others_us={name[:60]: round(us, 2) for name, us in list(others.items())[:7]},
    )


def measure_ceilings(trials: int, dry: bool = False) -> dict:
    n = 1 << (20 if dry else 30)  # 2 GiB of bf16
    xs = [jax.random.normal(jax.random.key(i), (n,), jnp.bfloat16) for i in range(3)]
    t_scale = back_to_back(jax.jit(lambda a: a * 2), xs, 4 * trials)
    t_copy = back_to_back(jax.jit(jnp.copy), xs, 4 * trials)
    del xs
    m = 256 if dry else 8192
    b = jax.random.normal(jax.random.key(9), (m, m), jnp.bfloat16)
    as_ = [jax.random.normal(jax.random.key(10 + i), (m, m), jnp.bfloat16) for i in range(4)]
    matmul = jax.jit(jnp.matmul)
    t_mm = back_to_back(lambda a_: matmul(a_, b), as_, 4 * trials)
    res = dict(
        copy_tbs=4 * n / t_copy / 1e12,
        scale_tbs=4 * n / t_scale / 1e12,
        matmul_tflops=2 * m**3 / t_mm / 1e12,
    )
    try:  # the copy engine's own rate: a device-to-device copy through PyTorch, where present
        import torch

        if torch.cuda.is_available():
            src = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
            dst = torch.empty_like(src)
            for _ in range(3):
                dst.copy_(src)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(20):
                dst.copy_(src)
            torch.cuda.synchronize()
            res["torch_copy_tbs"] = 4 * n * 20 / (time.perf_counter() - t0) / 1e12
            del src, dst
            torch.cuda.empty_cache()
    except Exception as e:  # noqa: BLE001
        res["torch_copy_error"] = str(e)[:200]
    res["copy_bw_tbs"] = max(res["copy_tbs"], res["scale_tbs"], res.get("torch_copy_tbs", 0.0))
    log(kind="ceilings", **res)
    return res


# ----------------------------------------------------------------------------------------------
# Problems


def build_step(
    rng,
    *,
    q_lens,
    kv_lens,
    num_seqs,
    num_tokens,
    hq,
    hkv,
    d,
    page_size,
    pages_per_seq,
    num_decode,
    rotations,
    dtype=jnp.bfloat16,
):
    """Random step: q, one KV pool, `rotations` page tables over disjoint pages (same shapes)."""
    n = len(q_lens)
    need = [-(-k // page_size) for k in kv_lens]
    per_rot = sum(need)
    num_pages = 1 + per_rot * rotations
    kv = jax.random.normal(
        jax.random.key(int(rng.integers(1 << 30))), (num_pages, hkv, 2, page_size, d), dtype
    )
    perm = rng.permutation(np.arange(1, num_pages))
    tables = []
    for r in range(rotations):
        pt = np.zeros((num_seqs, pages_per_seq), np.int32)
        off = r * per_rot
        for i, k in enumerate(need):
            pt[i, :k] = perm[off : off + k]
            off += k
        tables.append(jnp.asarray(pt))
    lens = np.zeros(num_seqs, np.int32)
    lens[:n] = kv_lens
    cu = np.zeros(num_seqs + 1, np.int32)
    cu[1 : n + 1] = np.cumsum(q_lens)
    cu[n + 1 :] = cu[n]
    q = jax.random.normal(jax.random.key(int(rng.integers(1 << 30))), (num_tokens, hq, d), dtype)
    dist = jnp.asarray([num_decode, n], jnp.int32)
    return dict(q=q, kv=kv, kv_lens=jnp.asarray(lens), tables=tables, cu=jnp.asarray(cu), dist=dist)


def check_subset(out, p, *, sm_scale, num_check: int) -> float:
    """Relative L2 error of the rows of the first num_check sequences against the reference."""
    cu = np.asarray(p["cu"])
    n = int(np.asarray(p["dist"])[1])
    k = min(n, num_check)
    rows = int(cu[k])
    dec = min(int(np.asarray(p["dist"])[0]), k)
    s = k + 1
    lens = p["kv_lens"][:s].at[k].set(0)
    cu_s = jnp.asarray(np.minimum(cu[: s + 1], rows))
    ref = ragged_paged_attention_reference(
        p["q"][: max(rows, 1)],
        p["kv"],
        lens,
        p["tables"][0][:s],
        cu_s,
        jnp.asarray([dec, k], jnp.int32),
        sm_scale=sm_scale,
    )
    return rel_err(out[:rows], ref[:rows])


def step_args(p, table=None) -> tuple:
    """build_step's step as the kernel's positional arguments (page table: the first, or table)."""
    pt = p["tables"][0] if table is None else table
    return p["q"], p["kv"], p["kv_lens"], pt, p["cu"], p["dist"]


def time_ours(p, *, sm_scale, tuning, reps, trials, a_operands="regs", profile=False):
    """(output, time per call, first call's seconds, device_times' dict when profile else {})."""

    def call(pt):
        return ragged_paged_attention_pallas(
            *step_args(p, pt),
            sm_scale=sm_scale,
            tuning=tuning,
            a_operands=a_operands,
        )

    t0 = time.perf_counter()
    out = jax.block_until_ready(call(p["tables"][0]))  # the jitted entry; arrays are arguments
    first_call_s = time.perf_counter() - t0  # compile (or compile-cache hit) + one run
    reps = max(reps, len(p["tables"]))
    tabs = [p["tables"][i % len(p["tables"])] for i in range(reps)]
    extra = device_times(call, tabs) if profile else {}
    return out, back_to_back(call, tabs, trials), first_call_s, extra


def time_tuned(p, args, layout, tuning, a_operands, *, profile):
    """time_ours with `tuning` resolved against the case's default_tuning (None: the default; a
    TuningConfig; or a function of the default, parse_tuning). Returns (tuning, *time_ours)."""
    hq, hkv, d = LAYOUTS[layout]
    base = default_tuning(
        num_seqs=p["kv_lens"].shape[0],
        num_kv_heads=hkv,
        head_dim=d,
        page_size=p["kv"].shape[3],
        pages_per_seq=p["tables"][0].shape[1],
        dtype=jnp.bfloat16,
        num_ctas=args.num_ctas,
        num_tokens=p["q"].shape[0],
        num_q_heads=hq,
    )
    tn = tuning(base) if callable(tuning) else (tuning or base)
    timed_ = time_ours(
        p,
        sm_scale=d**-0.5,
        tuning=tn,
        reps=args.reps,
        trials=args.trials,
        a_operands=a_operands,
        profile=profile,
    )
    return (tn, *timed_)


def time_jax_paged(p, *, sm_scale, reps, trials, num_decode):
    """JAX's Pallas Triton decode kernel on the same KV (its layout: k/v_pages [Hkv, P, PS, D])."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from jax.experimental.pallas.ops.gpu import paged_attention as jpa
    k_pages = jnp.swapaxes(p["kv"][:, :, 0], 0, 1)
    v_pages = jnp.swapaxes(p["kv"][:, :, 1], 0, 1)
    q = p["q"][:num_decode] * sm_scale  # it applies no softmax scale of its own
    lens = p["kv_lens"][:num_decode]
    page_size = p["kv"].shape[3]
    mp = -(-int(jnp.max(lens)) // page_size)  # its natural table width: just the context
    k_splits = 16 if mp % 16 == 0 else 1

    kernel = jax.jit(jpa.paged_attention, static_argnames=("k_splits",))

    def call(pt):
        return kernel(q, k_pages, v_pages, pt, lens, k_splits=k_splits)

    tables = [t[:num_decode, :mp] for t in p["tables"]]
    out = call(tables[0])
    reps = max(reps, len(tables))
    return out, back_to_back(call, [tables[i % len(tables)] for i in range(reps)], trials)


def time_cudnn_prefill(p, *, sm_scale, chunk, kv_len, reps, trials, profile=False):
    """cuDNN's flash attention (`jax.nn.dot_product_attention(implementation="cudnn")`, causal)
    on the prefill step's one sequence, gathered into contiguous q [1, T, Hq, D] and k, v
    [1, S, Hkv, D] (one copy per page table): the vendor's kernel on the same work, without
    paging. Returns (output [T, Hq, D], time per call, device_times' dict when profile else {})."""
    q = p["q"][None, :chunk]
    page_size = p["kv"].shape[3]
    n_pages = -(-kv_len // page_size)

    def contiguous(table, kind):  # [1, S, Hkv, D]
        pages = p["kv"][table[0, :n_pages], :, kind]  # [n, Hkv, PS, D]
        return jnp.swapaxes(pages, 1, 2).reshape(1, n_pages * page_size, -1, pages.shape[-1])[
            :, :kv_len
        ]

    kvs = [(contiguous(t, 0), contiguous(t, 1)) for t in p["tables"]]
    attend = jax.jit(
        lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, scale=sm_scale, is_causal=True, implementation="cudnn"
        )[0]
    )

    def call(kv):
        return attend(q, *kv)

    out = jax.block_until_ready(call(kvs[0]))
    xs = [kvs[i % len(kvs)] for i in range(max(reps, len(kvs)))]
    extra = device_times(call, xs) if profile else {}
    return out, back_to_back(call, xs, trials), extra


# ----------------------------------------------------------------------------------------------
# Phases


def decode_case(rng, batch, ctx, layout, page_size, *, pages_per_seq=None, rotations=None):
    hq, hkv, d = LAYOUTS[layout]
    kv_bytes = batch * ctx * hkv * 2 * d * 2
    if rotations is None:  # >= 256 MB touched per cycle of page tables where it costs little
        rotations = 1 if DRY else max(1, min(16, -(-256_000_000 // kv_bytes)))
    mp = pages_per_seq or -(-ctx // page_size)
    p = build_step(
        rng,
        q_lens=[1] * batch,
        kv_lens=[ctx] * batch,
        num_seqs=batch,
        num_tokens=max(16, batch),
        hq=hq,
        hkv=hkv,
        d=d,
        page_size=page_size,
        pages_per_seq=mp,
        num_decode=batch,
        rotations=rotations,
    )
    return p, kv_bytes, d


def run_decode(
    rng, ceil, args, batch, ctx, layout, page_size, tunings, *, jax_baseline, pages_per_seq=None
):
    p, kv_bytes, d = decode_case(rng, batch, ctx, layout, page_size, pages_per_seq=pages_per_seq)
    sm_scale = d**-0.5
    rows = []
    for name, tn, a_ops in tunings:
        row = dict(kind="decode", batch=batch, ctx=ctx, layout=layout, page=page_size, impl=name)
        t_row = time.perf_counter()
        try:
            tn, out, t, first_s, _ = time_tuned(p, args, layout, tn, a_ops, profile=False)
            row.update(
                tuning=str(tn),
                a_operands=a_ops,
                err=check_subset(out, p, sm_scale=sm_scale, num_check=8),
                ms=t * 1e3,
                first_call_s=first_s,
                tbs=kv_bytes / t / 1e12,
            )
            row["pct_copy"] = 100 * row["tbs"] / ceil["copy_bw_tbs"]
        except Exception as e:  # noqa: BLE001 - report and go on
            row.update(error=f"{type(e).__name__}: {str(e)[:400]}")
            traceback.print_exc()
        row["wall_s"] = time.perf_counter() - t_row
        log(**row)
        rows.append(row)
    if jax_baseline:
        row = dict(
            kind="decode", batch=batch, ctx=ctx, layout=layout, page=page_size, impl="jax_paged"
        )
        t_row = time.perf_counter()
        try:
            out, t = time_jax_paged(
                p, sm_scale=sm_scale, reps=args.reps, trials=args.trials, num_decode=batch
            )
            row.update(
                err=check_subset(out, p, sm_scale=sm_scale, num_check=8),
                ms=t * 1e3,
                tbs=kv_bytes / t / 1e12,
            )
            row["pct_copy"] = 100 * row["tbs"] / ceil["copy_bw_tbs"]
        except Exception as e:  # noqa: BLE001
            row.update(error=f"{type(e).__name__}: {str(e)[:400]}")
        row["wall_s"] = time.perf_counter() - t_row
        log(**row)
        rows.append(row)
    del p
    return rows


# Page-table rows of a prefill case: an engine bucket has max_num_seqs rows (256 in the
# h200-throughput preset), and default_tuning reads the row count. With a handful of rows it would
# give the bucket split decode (smaller KV blocks, one decode warpgroup, one producer thread),
# which no engine prefill bucket runs; so the "default" rows are the engine's schedule.
PREFILL_ROWS = 256


def prefill_case(rng, layout, chunk, prefix, page_size, *, rotations, rows=PREFILL_ROWS):
    """build_step's step of one prefill chunk of `chunk` tokens after `prefix` cached ones, in a
    page table of `rows` rows (the rest padding rows)."""
    hq, hkv, d = LAYOUTS[layout]
    kv_len = chunk + prefix
    return build_step(
        rng,
        q_lens=[chunk],
        kv_lens=[kv_len],
        num_seqs=rows,
        num_tokens=chunk,
        hq=hq,
        hkv=hkv,
        d=d,
        page_size=page_size,
        pages_per_seq=-(-kv_len // page_size),
        num_decode=0,
        rotations=rotations,
    )


def run_prefill(
    rng, ceil, args, chunk, prefix, layout, page_size, tuning=None, a_ops="regs", impl="ours"
):
    """One prefill row: ours (tuning: None for the default, a TuningConfig, or a function of the
    default) or, with impl "cudnn", cuDNN's flash attention on the same work."""
    hq, hkv, d = LAYOUTS[layout]
    kv_len = chunk + prefix
    p = prefill_case(rng, layout, chunk, prefix, page_size, rotations=2)
    sm_scale = d**-0.5
    pairs = chunk * prefix + chunk * (chunk + 1) / 2
    flops = 4 * d * hq * pairs
    row = dict(kind="prefill", chunk=chunk, prefix=prefix, layout=layout, page=page_size, impl=impl)
    t_row = time.perf_counter()
    try:
        if impl == "cudnn":
            out, t, extra = time_cudnn_prefill(
                p,
                sm_scale=sm_scale,
                chunk=chunk,
                kv_len=kv_len,
                reps=args.reps,
                trials=args.trials,
                profile=args.device_times,
            )
        else:
            tn, out, t, first_s, extra = time_tuned(
                p, args, layout, tuning, a_ops, profile=args.device_times
            )
            row.update(tuning=str(tn), a_operands=a_ops, first_call_s=first_s)
        row.update(
            err=check_subset(out, p, sm_scale=sm_scale, num_check=1),
            ms=t * 1e3,
            tflops=flops / t / 1e12,
        )
        row["pct_matmul"] = 100 * row["tflops"] / ceil["matmul_tflops"]
        row.update(extra)
        if "kernel_ms" in extra:
            row["kernel_tflops"] = flops / extra["kernel_ms"] / 1e9
    except Exception as e:  # noqa: BLE001
        row.update(error=f"{type(e).__name__}: {str(e)[:400]}")
        traceback.print_exc()
    row["wall_s"] = time.perf_counter() - t_row
    log(**row)
    return row


def run_kv_write(rng, args, layout, batch, ctx, chunk):
    """The engine's layer call (`attention_step`: the KV write, an XLA scatter, then the kernel)
    jitted with the pages donated, as the engine runs it; called `--reps` times in a row under the
    profiler. Reports the device time per call of the scatter and of the attention kernel.
    Decode: batch sequences of ctx tokens, each writing its last token. Prefill (batch 0): one
    fresh chunk of `chunk` tokens writing all of them."""
    hq, hkv, d = LAYOUTS[layout]
    page_size = args.page_size
    if batch:
        p, _, _ = decode_case(rng, batch, ctx, layout, page_size, rotations=1)
        positions = np.full(batch, ctx - 1)
    else:
        ctx = chunk
        p = prefill_case(rng, layout, chunk, 0, page_size, rotations=1)
        positions = np.arange(chunk)
    table = np.asarray(p["tables"][0])
    num_tokens = p["q"].shape[0]
    seq = np.arange(batch) if batch else np.zeros(chunk, np.int64)
    slots = np.zeros(num_tokens, np.int32)  # padding tokens write into the null page
    slots[: len(positions)] = table[seq, positions // page_size] * page_size + positions % page_size
    k, v = (
        jax.random.normal(jax.random.key(int(rng.integers(1 << 30))), (num_tokens, hkv, d)).astype(
            jnp.bfloat16
        )
        for _ in range(2)
    )
    step = jax.jit(
        functools.partial(attention_step, sm_scale=d**-0.5, backend="pallas"), donate_argnums=3
    )
    row = dict(kind="kv_write", layout=layout, batch=batch, ctx=ctx, page=page_size)
    kv_bytes_written = 2 * 2 * len(positions) * hkv * d
    try:
        kv = p["kv"]
        rest = (jnp.asarray(slots), p["kv_lens"], p["tables"][0], p["cu"], p["dist"])
        for _ in range(3):  # compile, warm up
            out, kv = step(p["q"], k, v, kv, *rest)
        jax.block_until_ready(kv)

        def run():
            nonlocal out, kv
            for _ in range(args.reps):
                out, kv = step(p["q"], k, v, kv, *rest)
            jax.block_until_ready((out, kv))

        total = traced_kernel_totals(run)
        per_call = {name[:60]: t / args.reps / 1e3 for name, t in total.most_common(8)}  # us
        write_us = sum(t for name, t in per_call.items() if "scatter" in name)
        attention_us = sum(t for name, t in per_call.items() if "mosaic" in name)
        row.update(
            write_us=write_us,
            attention_us=attention_us,
            kernels_us={name: round(t, 2) for name, t in per_call.items()},
            written_mb=kv_bytes_written / 1e6,
            write_gbs=kv_bytes_written / write_us / 1e3 if write_us else 0.0,
        )
    except Exception as e:  # noqa: BLE001
        row.update(error=f"{type(e).__name__}: {str(e)[:400]}")
        traceback.print_exc()
    log(**row)
    return row


def run_mixed_checks(rng, args):
    """Correctness only: decode + prefill chunks (with cached prefixes) in one step, several
    shapes."""
    cases = [
        ("32q/8kv/128", 16, [(1, 700), (1, 33), (1, 1), (300, 300), (129, 1000), (0, 0)]),
        ("9q/3kv/64", 64, [(1, 64), (1, 65), (200, 455), (17, 17)]),
        ("32q/8kv/64", 256, [(1, 257), (1, 1000), (64, 64), (100, 612)]),
        # Prefill buckets (2,048 tokens and more): head_dim 64 takes three compute warpgroups,
        # with split decode (few sequences) and with whole decode on two warpgroups (many).
        ("32q/8kv/64", 16, [(1, 300), (1, 17), (1900, 2500), (150, 150)]),
        ("9q/3kv/64", 64, [(1, 64), (1, 65), (2000, 2455), (60, 60)]),
        ("32q/8kv/64", 16, [(1, 100 + 37 * i) for i in range(40)] + [(2048, 2048)]),
    ]
    for layout, ps, seqs in cases:
        hq, hkv, d = LAYOUTS[layout]
        ndec = sum(1 for ql, _ in seqs if ql == 1)
        qs = [ql for ql, _ in seqs]
        ks = [kl for _, kl in seqs]
        t = max(16, sum(qs))
        p = build_step(
            rng,
            q_lens=qs,
            kv_lens=ks,
            num_seqs=len(seqs) + 2,
            num_tokens=t,
            hq=hq,
            hkv=hkv,
            d=d,
            page_size=ps,
            pages_per_seq=-(-max(ks) // ps) + 1,
            num_decode=ndec,
            rotations=1,
        )
        for soft_cap, a_ops in ((None, "regs"), (30.0, "smem")):
            if True:
                row = dict(
                    kind="mixed_check",
                    layout=layout,
                    page=ps,
                    tokens=t,
                    soft_cap=soft_cap,
                    a_operands=a_ops,
                )
                try:
                    # The SMEM-operand form needs room for Q and P tiles: small blocks, no splits.
                    tn = TuningConfig(64, 2, 1, args.num_ctas) if a_ops == "smem" else None
                    out = ragged_paged_attention_pallas(
                        *step_args(p),
                        sm_scale=d**-0.5,
                        soft_cap=soft_cap,
                        a_operands=a_ops,
                        tuning=tn,
                    )
                    ref = ragged_paged_attention_reference(
                        *step_args(p),
                        sm_scale=d**-0.5,
                        soft_cap=soft_cap,
                    )
                    row.update(
                        err=rel_err(out, ref), pad_rows_zero=bool(jnp.all(out[sum(qs) :] == 0))
                    )
                except Exception as e:  # noqa: BLE001
                    row.update(error=f"{type(e).__name__}: {str(e)[:400]}")
                    traceback.print_exc()
                log(**row)


# --decode-tunings / --prefill-tunings flags: the TuningConfig fields each one sets.
TUNING_FLAGS = {
    "wg1": {"decode_wgs": 1},
    "wg2": {"decode_wgs": 2},
    "pp": {"pingpong": True},
    "nopp": {"pingpong": False},
    "pw1": {"producer_warps": 1},
    "pw4": {"producer_warps": 4},
    "cw2": {"compute_wgs": 2},
    "cw3": {"compute_wgs": 3, "pingpong": False},  # ping-pong is a two-warpgroup schedule
    "mrs": {"mma_row_sums": True},
    "nomrs": {"mma_row_sums": False},
    **{f"ks{k}": {"prefill_kv_splits": k} for k in (1, 2, 3, 4, 8)},
    "early": {"fp8_convert_early": True},  # fp8 pages only
    "noearly": {"fp8_convert_early": False},
    "qk": {"fp8_qk": True},  # fp8 pages only
    "noqk": {"fp8_qk": False},  # fp8 decode buckets: back to converting K
    # both compute warpgroups on every decode item (one decode owner: warpgroup 0), or (ilK) on
    # the items of at least K blocks, the others alternating owners
    "il": {"decode_interleave": 1, "decode_wgs": 1},
    **{f"il{k}": {"decode_interleave": k, "decode_wgs": 2} for k in (2, 4, 8, 12, 16)},
    # prefill tiles of one Q box, both compute warpgroups on every other block (no ping-pong)
    "pil": {
        "prefill_interleave": True,
        "compute_wgs": 2,
        "pingpong": False,
        "prefill_kv_splits": 1,
    },
    "nopil": {"prefill_interleave": False},
    # each call's plan picks interleaved one-box tiles or paired ones (schedule.interleave_pays);
    # ping-pong stays as set (add "pp" for the paired tiles' turns)
    "pils": {"prefill_interleave": "per_step", "compute_wgs": 2, "prefill_kv_splits": 1},
}


def parse_tuning(spec: str, num_ctas: int):
    """A --decode-tunings / --prefill-tunings entry as a function of the default tuning.

    "BLOCKxSTAGESxSPLITS[xFLAG...]" is that schedule in its plain form (one decode warpgroup, no
    ping-pong) plus the flags; "default[xFLAG...]" is default_tuning's choice for the case with
    only the flags changed. Flags: TUNING_FLAGS."""
    head, *rest = spec.split("x")
    if head == "default":
        shape, flags = None, rest
    else:
        shape, flags = tuple(int(v) for v in [head, *rest[:2]]), rest[2:]
        if len(shape) != 3:
            raise SystemExit(f"tuning {spec!r}: want BLOCKxSTAGESxSPLITS[xFLAG...]")
    unknown = set(flags) - set(TUNING_FLAGS)
    if unknown:
        raise SystemExit(f"tuning {spec!r}: unknown flags {sorted(unknown)}")
    changes = {k: v for f in flags for k, v in TUNING_FLAGS[f].items()}  # later flags win

    def resolve(default: TuningConfig) -> TuningConfig:
        if shape is None:
            return dataclasses.replace(default, **changes)
        return TuningConfig(*shape, num_ctas, **changes)

    resolve(TuningConfig(num_ctas=num_ctas))  # an invalid spec fails before any work
    return resolve


def prefill_variants(head_dim: int, num_ctas: int) -> list[TuningConfig]:
    """Explicit KV blocks for --prefill-variants: 64 x 3 and 128 x 2 stages, and for head_dim 64
    (whose blocks are half the bytes) 128 x 4 and 256 x 2; only those that fit shared memory.
    With ping-pong, as the default tuning has it."""
    shapes = [(64, 3), (128, 2)] + ([(128, 4), (256, 2)] if head_dim <= 64 else [])
    tunings = [TuningConfig(bk, stages, 1, num_ctas, pingpong=True) for bk, stages in shapes]
    return [t for t in tunings if t.smem_bytes(head_dim, jnp.bfloat16) <= SMEM_BYTES - SMEM_SLACK]


def headline_tunings(num_ctas: int) -> list:
    return [
        ("ours bk128 s2", TuningConfig(128, 2, 1, num_ctas), "regs"),
        ("ours bk64 s3", TuningConfig(64, 3, 1, num_ctas), "regs"),
        ("ours bk64 s4", TuningConfig(64, 4, 1, num_ctas), "regs"),
        ("ours bk64 s3 smemA", TuningConfig(64, 3, 1, num_ctas), "smem"),
        ("ours default", None, "regs"),
    ]


def ceilings(args) -> dict:
    path = os.path.join(args.out, "ceilings.json")
    if os.path.exists(path):
        with open(path) as f:
            res = json.load(f)
        log(kind="ceilings_reused", **res)
        return res
    res = measure_ceilings(args.trials, dry=args.dry)
    with open(path, "w") as f:
        json.dump(res, f)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--phase", default="smoke", choices=["smoke", "mixed", "decode", "prefill", "kvwrite"]
    )
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--batches", default="1,32,256,512")
    ap.add_argument("--ctxs", default="512,2048,8192")
    ap.add_argument("--chunks", default="512,1024,2048,4096,8192,2048+6144")
    ap.add_argument("--no-jax-baseline", action="store_true")
    ap.add_argument("--decode-list", default="", help='"layout,batch,ctx;..." instead of the grid')
    ap.add_argument(
        "--decode-tunings",
        default="",
        help='extra decode tunings next to the default, "BLOCKxSTAGESxSPLITS[xFLAG]" or '
        '"default[xFLAG]", e.g. "64x3x2,64x3x1xwg2,defaultxwg1" (see parse_tuning)',
    )
    ap.add_argument(
        "--prefill-tunings",
        default="",
        help='extra prefill tunings next to the default, as --decode-tunings, e.g. "defaultxnopp"',
    )
    ap.add_argument(
        "--prefill-variants",
        action="store_true",
        help="also time explicit KV blocks (see prefill_variants)",
    )
    ap.add_argument(
        "--device-times",
        action="store_true",
        help="prefill: also the kernel's own device time per call, from a profiler trace",
    )
    ap.add_argument(
        "--kv-write-cases",
        default="32q/8kv/128,256,1024;9q/3kv/64,256,2048;32q/8kv/128,0,8192;9q/3kv/64,0,8192",
        help='kvwrite: "layout,batch,ctx;..." (batch 0: one fresh prefill chunk of ctx tokens)',
    )
    ap.add_argument(
        "--cudnn-baseline",
        action="store_true",
        help="prefill from position 0: also cuDNN's flash attention on the same work",
    )
    ap.add_argument(
        "--dry", action="store_true", help="tiny ceilings (CPU dry runs of this script)"
    )
    args = ap.parse_args()
    global DRY
    DRY = args.dry
    os.makedirs(args.out, exist_ok=True)
    dev = jax.devices()[0]
    args.num_ctas = getattr(dev, "core_count", None) or (3 if args.dry else 132)
    log(
        kind="env",
        device=str(dev),
        device_kind=getattr(dev, "device_kind", "?"),
        jax=jax.__version__,
        num_ctas=args.num_ctas,
        argv=sys.argv[1:],
    )
    decode_tunings = [("ours", None, "regs")] + [  # parsed first: a typo fails before any work
        (f"ours {spec}", parse_tuning(spec, args.num_ctas), "regs")
        for spec in filter(None, args.decode_tunings.split(","))
    ]
    prefill_tunings = [
        (f"ours {spec}", parse_tuning(spec, args.num_ctas))
        for spec in filter(None, args.prefill_tunings.split(","))
    ]
    rng = np.random.default_rng(0)
    ceil = ceilings(args)
    rows = []
    layouts = args.layouts.split(",")
    if args.phase == "mixed":  # correctness only: mixed steps in three layouts
        run_mixed_checks(rng, args)
    if args.phase == "smoke":
        run_mixed_checks(rng, args)
        rows += run_decode(
            rng,
            ceil,
            args,
            256,
            1024,
            "32q/8kv/128",
            16,
            headline_tunings(args.num_ctas),
            jax_baseline=True,
        )
    if args.phase == "decode" and args.decode_list:  # "layout,batch,ctx;..." in one process
        cases = [c.split(",") for c in args.decode_list.split(";")]
        for layout, batch, ctx in cases:
            mp = -(-max(int(c[2]) for c in cases if c[0] == layout) // args.page_size)
            rows += run_decode(
                rng,
                ceil,
                args,
                int(batch),
                int(ctx),
                layout,
                args.page_size,
                decode_tunings,
                pages_per_seq=mp,
                jax_baseline=not args.no_jax_baseline,
            )
    elif args.phase == "decode":
        for layout in layouts:
            # One page-table width per layout (the longest context), as an engine would have.
            mp = -(-max(map(int, args.ctxs.split(","))) // args.page_size)
            for batch in map(int, args.batches.split(",")):
                for ctx in map(int, args.ctxs.split(",")):
                    rows += run_decode(
                        rng,
                        ceil,
                        args,
                        batch,
                        ctx,
                        layout,
                        args.page_size,
                        decode_tunings,
                        pages_per_seq=mp,
                        jax_baseline=not args.no_jax_baseline,
                    )
    if args.phase == "prefill":
        for layout in layouts:
            variants = [("ours", None)] + prefill_tunings
            if args.prefill_variants:
                variants += [
                    (f"ours bk{tn.block_kv} s{tn.num_stages}", tn)
                    for tn in prefill_variants(LAYOUTS[layout][2], args.num_ctas)
                ]
            for spec in args.chunks.split(","):  # "chunk" or "chunk+cached_prefix"
                chunk, _, prefix = spec.partition("+")
                # cuDNN's causal mask is aligned top-left (query i sees keys 0..i): after a
                # cached prefix it is other work (relative error 3.6-7.4, docs/benchmarks.md).
                cudnn = args.cudnn_baseline and not prefix
                runs = variants + ([("cudnn", None)] if cudnn else [])
                for name, tn in runs:
                    rows.append(
                        run_prefill(
                            rng,
                            ceil,
                            args,
                            int(chunk),
                            int(prefix or 0),
                            layout,
                            args.page_size,
                            tuning=tn,
                            impl=name,
                        )
                    )
    if args.phase == "kvwrite":
        for case in args.kv_write_cases.split(";"):
            layout, batch, ctx = case.split(",")
            n = int(ctx)
            rows.append(run_kv_write(rng, args, layout, int(batch), n, n))
    with open(os.path.join(args.out, f"attention_bench_{args.phase}.json"), "w") as f:
        json.dump(LOG, f, indent=1)
    print_table(ceil, rows)


def print_table(ceil, rows) -> None:
    print(
        f"\nceilings: copy {ceil['copy_bw_tbs']:.2f} TB/s (jnp.copy {ceil['copy_tbs']:.2f}, x*2 "
        f"{ceil['scale_tbs']:.2f}, torch D2D {ceil.get('torch_copy_tbs', 0):.2f}), "
        f"bf16 matmul {ceil['matmul_tflops']:.0f} TFLOP/s"
    )
    print(f"{'case':44s} {'impl':20s} {'ms':>9s} {'rate':>12s} {'%ceil':>6s} {'relerr':>8s}")
    for r in rows:
        if r["kind"] == "kv_write":
            what = f"decode B={r['batch']} ctx={r['ctx']}" if r["batch"] else f"prefill {r['ctx']}"
            case = f"kv write, {what} {r['layout']} p{r['page']}"
            if "error" in r:
                print(f"{case:44s} ERROR {r['error'][:60]}")
                continue
            print(
                f"{case:44s} scatter {r['write_us']:.1f} us ({r['written_mb']:.2f} MB,"
                f" {r['write_gbs']:.0f} GB/s), attention kernel {r['attention_us']:.1f} us;"
                f" all: {r['kernels_us']}"
            )
            continue
        if r["kind"] == "decode":
            case = f"decode B={r['batch']} ctx={r['ctx']} {r['layout']} p{r['page']}"
            rate = f"{r.get('tbs', 0):.2f} TB/s"
            pct = r.get("pct_copy", 0)
        else:
            case = f"prefill {r['chunk']}+{r['prefix']} {r['layout']} p{r['page']}"
            rate = f"{r.get('tflops', 0):.0f} TF/s"
            pct = r.get("pct_matmul", 0)
        if "error" in r:
            print(f"{case:44s} {r['impl']:20s} ERROR {r['error'][:60]}")
        else:
            kernel = ""
            if "kernel_ms" in r:  # --device-times: the kernel alone, and the ops around it
                kernel = (
                    f"  kernel {r['kernel_ms']:.3f} ms {r['kernel_tflops']:.0f} TF/s"
                    f" {100 * r['kernel_tflops'] / ceil['matmul_tflops']:.1f}%,"
                    f" others {r['others_ms']:.3f} ms"
                )
            print(
                f"{case:44s} {r['impl']:20s} {r['ms']:9.3f} {rate:>12s} {pct:6.1f} {r['err']:8.1e}"
                + kernel
            )


if __name__ == "__main__":
    main()
