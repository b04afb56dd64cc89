"""FP8 KV pages on the GPU in one call: decode and prefill correctness against the reference, then
decode KV bandwidth with bf16 pages against fp8 pages; table last.

    PYTHONPATH=. python benchmarks/kernels/fp8_kv_check.py --out DIR

Correctness: mixed steps (decode rows and prefill chunks after cached prefixes) and a decode-only
and a prefill-only bucket, for e4m3 and e5m2 pages with calibrated scales; the kernel against the
reference on the same fp8 pages (relative L2 error; bf16 pages run the same check as a baseline),
and the fp8 reference against the bf16 reference on the unquantized values (what quantization
costs). A bucket whose schedule reads Q rows in fp8 (tuning.fp8_qk, fp8 decode buckets by
default) is checked against the reference on that Q (reference.quantize_query_rows) and on fp8
pages P rounded as the kernel rounds it (fp8_probs), and the table adds its distance from the
reference on Q as given.

Decode: batch 256/512/1024 x ctx 1024 (--decode-list), 32q/8kv/128 and 9q/3kv/64, page 64,
default tuning; bf16 and e4m3 pages alternate (bf16, fp8, bf16, fp8) in one process, as every A/B of
the project runs. KV bytes read per call are batch x ctx x kv heads x 2 x head_dim x bytes per
value, so at equal TB/s fp8 is twice the tokens per second; `speedup` is bf16 time / fp8 time.
`--prefill-list` times prefill chunks (after a cached prefix) the same way, in TFLOP/s.
`--convert-early` adds a third form: fp8 pages' K converted off the critical path (the next K
under P V: tuning.fp8_convert_early; only where Q K^T does not read K in fp8), on the default
schedule, its KV block halved where SMEM needs it. `--fp8-tunings` adds fp8 forms on other
schedules (attention_bench's --decode-tunings syntax, plus the flag "early"); one that does not
fit SMEM is reported and skipped.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.kv_layout import calibrate_kv_scales, quantize_pages
from pallas_kernels.ragged_paged_attention.pallas_attention import (
    bucket_tuning,
    ragged_paged_attention_pallas,
)
from pallas_kernels.ragged_paged_attention.reference import (
    QUERY_DTYPE,
    quantize_query_rows,
    ragged_paged_attention_reference,
)
from pallas_kernels.ragged_paged_attention.tuning import SMEM_BYTES, SMEM_SLACK, default_tuning

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attention_bench import (  # noqa: E402
    LAYOUTS,
    back_to_back,
    build_step,
    device_times,
    measure_ceilings,
    parse_tuning,
    prefill_case,
    rel_err,
)

FP8 = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}
ROWS: list[dict] = []


def log(**row):
    ROWS.append(row)
    print(json.dumps(row), flush=True)


def to_fp8(kv: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """bf16 pages [P, Hkv, 2, PS, D] as fp8 pages with calibrated (k, v) scales."""
    scales = calibrate_kv_scales(kv[:, :, 0], kv[:, :, 1], dtype)
    return quantize_pages(kv, scales, dtype), scales


def step_of(rng, layout, seqs, page_size, extra_seqs=2):
    """build_step over (q_len, kv_len) pairs, decode rows (q_len 1) first."""
    hq, hkv, d = LAYOUTS[layout]
    q_lens = [a for a, _ in seqs]
    kv_lens = [b for _, b in seqs]
    return build_step(
        rng,
        q_lens=q_lens,
        kv_lens=kv_lens,
        num_seqs=len(seqs) + extra_seqs,
        num_tokens=max(16, sum(q_lens)),
        hq=hq,
        hkv=hkv,
        d=d,
        page_size=page_size,
        pages_per_seq=-(-max(kv_lens) // page_size) + 1,
        num_decode=sum(1 for a in q_lens if a == 1),
        rotations=1,
    )


CHECKS = [  # (name, layout, page size, (q_len, kv_len) per sequence)
    ("mixed", "32q/8kv/128", 32, [(1, 700), (1, 33), (1, 1), (300, 300), (129, 1000), (0, 0)]),
    ("mixed", "9q/3kv/64", 64, [(1, 64), (1, 65), (200, 455), (17, 17)]),
    ("mixed", "32q/8kv/64", 32, [(1, 300), (1, 17), (1900, 2500), (150, 150)]),  # 3 warpgroups
    ("decode", "32q/8kv/128", 32, [(1, 1024 + 37 * i) for i in range(64)]),
    ("prefill", "9q/3kv/64", 64, [(4096, 4096)]),
    # fp8 decode at head_dim 64 interleaves items of 12+ blocks (tuning.decode_interleave):
    # long items, short ones between them (one owner each), and hand-overs to both warpgroups
    ("decode", "9q/3kv/64", 64, [(1, 1500 + 97 * i) if i % 3 else (1, 90 + i) for i in range(48)]),
]


def run_checks(rng) -> None:
    for kind, layout, ps, seqs in CHECKS:
        p = step_of(rng, layout, seqs, ps)
        d = LAYOUTS[layout][2]
        args = (p["q"], p["kv"], p["kv_lens"], p["tables"][0], p["cu"], p["dist"])
        kw = dict(sm_scale=d**-0.5)
        ref16 = ragged_paged_attention_reference(*args, **kw)
        for name in ("bf16", *FP8):
            row = dict(kind="check", step=kind, layout=layout, page=ps, pages=name)
            try:
                if name == "bf16":
                    a, extra = args, {}
                else:
                    pages, scales = to_fp8(p["kv"], FP8[name])
                    a, extra = (args[0], pages, *args[2:]), {"kv_scales": scales}
                out = ragged_paged_attention_pallas(*a, **kw, **extra)
                ref = ragged_paged_attention_reference(*a, **kw, **extra)
                n = int(np.asarray(p["cu"])[int(np.asarray(p["dist"])[1])])
                row.update(
                    quant_err_vs_bf16=rel_err(ref[:n], ref16[:n]),
                    pad_rows_zero=bool(jnp.all(out[n:] == 0)),
                )
                # checked on the Q and P it reads: Q rows in e4m3 where the schedule says so,
                # P in e4m3 on fp8 pages (reference.quantize_probs)
                q_read = a[0]
                if bucket_tuning(a[0], a[1], a[3]).fp8_qk:
                    q_read = quantize_query_rows(a[0], QUERY_DTYPE)
                    row.update(q_rows_fp8=True, q_err_vs_ref=rel_err(out[:n], ref[:n]))
                if name != "bf16":
                    extra["fp8_probs"] = True
                ref = ragged_paged_attention_reference(q_read, *a[1:], **kw, **extra)
                row.update(err_vs_ref=rel_err(out[:n], ref[:n]))
            except Exception as e:  # noqa: BLE001 - report and go on
                row.update(error=f"{type(e).__name__}: {str(e)[:400]}")
                traceback.print_exc()
            log(**row)


def run_decode(rng, ceil, args, layout, batch, ctx) -> None:
    p = step_of(rng, layout, [(1, ctx)] * batch, args.page_size, extra_seqs=0)
    time_forms(ceil, args, p, layout, dict(kind="decode", batch=batch, ctx=ctx))


def run_prefill(rng, ceil, args, layout, chunk, prefix) -> None:
    """One chunk of `chunk` tokens after `prefix` cached ones: a prefill bucket from 2,048 tokens
    on (bf16's schedule, Q as given), a decode bucket below (tuning.reads_fp8_query)."""
    p = prefill_case(rng, layout, chunk, prefix, args.page_size, rotations=1)
    time_forms(ceil, args, p, layout, dict(kind="prefill", chunk=chunk, prefix=prefix))


def time_forms(ceil, args, p, layout, case: dict) -> None:
    """bf16 pages, e4m3 pages on the default schedule, and the --fp8-tunings forms on one step,
    alternating; each form's error on its first rows against the reference (on the per-row fp8 Q
    where the form reads Q in fp8)."""
    hq, hkv, d = LAYOUTS[layout]
    shape = {k: v for k, v in case.items() if k != "kind"}  # batch, ctx or chunk, prefix
    pages8, scales = to_fp8(p["kv"], jnp.float8_e4m3fn)
    forms = {"bf16": (p["kv"], None, None), "fp8_e4m3": (pages8, scales, None)}
    if args.convert_early:  # tuning.fp8_convert_early on the default schedule
        forms["fp8_e4m3 early"] = (pages8, scales, convert_early_tuning(p, hq, hkv, d, args))
    for spec, resolve in args.fp8_tunings:
        cfg = resolve(default_of(p, hq, hkv, d, args))
        need = cfg.smem_bytes(d, p["q"].dtype, kv_dtype=jnp.dtype(jnp.float8_e4m3fn))
        if need > SMEM_BYTES - SMEM_SLACK:
            log(kind="tuning_skipped", layout=layout, **shape, spec=spec, smem=need)
            continue
        forms[f"fp8 {spec}"] = (pages8, scales, cfg)
    fns = {}
    for name, (pages, sc, tuning) in forms.items():
        extra = {} if sc is None else {"kv_scales": sc}
        if tuning is not None:
            extra["tuning"] = tuning
            log(kind="tuning", form=name, layout=layout, **shape, tuning=str(tuning))

        def call(pt, pages=pages, extra=extra):
            return ragged_paged_attention_pallas(
                p["q"], pages, p["kv_lens"], pt, p["cu"], p["dist"], sm_scale=d**-0.5, **extra
            )

        fns[name] = call
    tables = [p["tables"][0]] * args.reps
    times = {name: [] for name in forms}
    errs = {}
    # rows checked: the first 8 decode sequences, or the chunk's first 256 tokens
    n = min(8, case["batch"]) if case["kind"] == "decode" else min(256, case["chunk"])
    for name, fn in fns.items():  # compile, check the first n rows
        out = jax.block_until_ready(fn(p["tables"][0]))
        pages, sc, tuning = forms[name]
        q = p["q"]
        if (tuning or bucket_tuning(p["q"], pages, p["tables"][0])).fp8_qk:
            q = quantize_query_rows(q, QUERY_DTYPE)  # checked on the Q (and P) it reads
        fp8_probs = sc is not None
        if case["kind"] == "decode":  # n one-token sequences
            ref = ragged_paged_attention_reference(
                q[:n],
                pages,
                p["kv_lens"][:n],
                p["tables"][0][:n],
                jnp.arange(n + 1, dtype=jnp.int32),
                jnp.asarray([n, n], jnp.int32),
                sm_scale=d**-0.5,
                kv_scales=sc,
                fp8_probs=fp8_probs,
            )
        else:  # the whole step (one sequence)
            args_ = (q, pages, p["kv_lens"], p["tables"][0], p["cu"], p["dist"])
            ref = ragged_paged_attention_reference(
                *args_, sm_scale=d**-0.5, kv_scales=sc, fp8_probs=fp8_probs
            )[:n]
        errs[name] = rel_err(out[:n], ref)
    for _ in range(args.alternations):  # A B A B
        for name, fn in fns.items():
            times[name].append(back_to_back(fn, tables, args.trials))
    # the kernel's own device time per call, from a trace, apart from the call's small XLA
    # programs (the schedule's plan, the output's merge) that the time per call includes
    traced = (
        {name: device_times(fn, tables) for name, fn in fns.items()} if args.device_times else {}
    )
    if case["kind"] == "decode":
        kv_tokens = case["batch"] * case["ctx"]
    else:
        kv_tokens = case["chunk"] + case["prefix"]
        pairs = case["chunk"] * case["prefix"] + case["chunk"] * (case["chunk"] + 1) / 2
    for name in forms:
        t = float(np.median(times[name]))
        itemsize = 1 if name != "bf16" else 2
        kv_bytes = kv_tokens * hkv * 2 * d * itemsize
        row = dict(
            kind=case["kind"],
            layout=layout,
            **shape,
            pages=name,
            ms=t * 1e3,
            ms_each=[x * 1e3 for x in times[name]],
            tbs=kv_bytes / t / 1e12,
            pct_copy=100 * kv_bytes / t / 1e12 / ceil["copy_bw_tbs"],
            err=errs[name],
        )
        if traced.get(name, {}).get("kernel_ms"):
            k = traced[name]
            row.update(
                k,
                kernel_pct_copy=100
                * kv_bytes
                / (k["kernel_ms"] * 1e-3)
                / 1e12
                / ceil["copy_bw_tbs"],
            )
        if case["kind"] == "decode":
            row["tokens_per_s"] = case["batch"] / t
        else:
            row["tflops"] = 4 * d * hq * pairs / t / 1e12
        log(**row)
    rows = ROWS[-len(forms) :]
    for r in rows[1:]:
        r["speedup"] = rows[0]["ms"] / r["ms"]  # bf16 time / this form's


def default_of(p, hq, hkv, d, args):
    """default_tuning's schedule for this decode bucket with fp8 pages."""
    num_seqs, pages_per_seq = p["tables"][0].shape
    return default_tuning(
        num_seqs=num_seqs,
        num_kv_heads=hkv,
        head_dim=d,
        page_size=args.page_size,
        pages_per_seq=pages_per_seq,
        dtype=p["q"].dtype,
        num_tokens=p["q"].shape[0],
        num_q_heads=hq,
        num_ctas=getattr(jax.devices()[0], "core_count", None) or 132,
        kv_dtype=jnp.dtype(jnp.float8_e4m3fn),
    )


def convert_early_tuning(p, hq, hkv, d, args):
    """The default schedule of this decode bucket with fp8_convert_early, its KV block halved
    while it does not fit in SMEM."""
    kv8 = jnp.dtype(jnp.float8_e4m3fn)
    cfg = dataclasses.replace(default_of(p, hq, hkv, d, args), fp8_convert_early=True)
    while (
        cfg.block_kv > 64
        and cfg.smem_bytes(d, p["q"].dtype, kv_dtype=kv8) > SMEM_BYTES - SMEM_SLACK
    ):
        cfg = dataclasses.replace(cfg, block_kv=cfg.block_kv // 2)
    return cfg


def print_table(ceil) -> None:
    print(f"\nceilings: copy {ceil['copy_bw_tbs']:.2f} TB/s")
    print(f"{'check':44s} {'pages':9s} {'err vs ref':>11s} {'fp8 vs bf16':>12s}  pad=0")
    for r in ROWS:
        if r["kind"] != "check":
            continue
        case = f"{r['step']} {r['layout']} p{r['page']}"
        if "error" in r:
            print(f"{case:44s} {r['pages']:9s} ERROR {r['error'][:70]}")
        else:
            q8 = f"  Q rows fp8: {r['q_err_vs_ref']:.1e} from Q" if r.get("q_rows_fp8") else ""
            print(
                f"{case:44s} {r['pages']:9s} {r['err_vs_ref']:11.1e} "
                f"{r['quant_err_vs_bf16']:12.1e}  {r['pad_rows_zero']}{q8}"
            )
    print(f"\n{'decode':32s} {'pages':28s} {'ms':>8s} {'TB/s':>6s} {'%copy':>6s} {'speedup':>8s}")
    for r in ROWS:
        if r["kind"] == "decode":
            case = f"B={r['batch']} ctx={r['ctx']} {r['layout']}"
            print(_timed_line(case, r, f"{r['tbs']:6.2f} {r['pct_copy']:6.1f}"))
        elif r["kind"] == "tuning_skipped":
            where = f"B={r['batch']}" if "batch" in r else f"chunk={r['chunk']}+{r['prefix']}"
            print(f"{where} {r['layout']} {r['spec']}: skipped, {r['smem']} bytes of SMEM")
        elif r["kind"] in ("decode_error", "prefill_error"):
            print(f"{r['kind']} {r['layout']} {r['case']}: ERROR {r['error'][:80]}")
    if any(r["kind"] == "prefill" for r in ROWS):
        print(f"\n{'prefill':32s} {'pages':28s} {'ms':>8s} {'TFLOP/s':>8s} {'speedup':>8s}")
    for r in ROWS:
        if r["kind"] == "prefill":
            case = f"chunk={r['chunk']} after {r['prefix']} {r['layout']}"
            print(_timed_line(case, r, f"{r['tflops']:8.1f}"))


def _timed_line(case: str, r: dict, rate: str) -> str:
    speed = f"{r['speedup']:.2f}x" if "speedup" in r else ""
    line = f"{case:32s} {r['pages']:28s} {r['ms']:8.3f} {rate} {speed:>8s}  err {r['err']:.1e}"
    if "kernel_ms" in r:  # --device-times
        line += f"  kernel {r['kernel_ms']:.3f} ms"
        if "kernel_pct_copy" in r and r["kind"] == "decode":
            line += f" ({r['kernel_pct_copy']:.1f}% of copy), others {r['others_ms']:.3f} ms"
    return line


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--page-size", type=int, default=64)  # fp8 pages: >= 32
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--alternations", type=int, default=2)
    ap.add_argument(
        "--decode-list",
        default=";".join(
            f"{layout},{b},1024"
            for layout in ("32q/8kv/128", "9q/3kv/64")
            for b in (256, 512, 1024)
        ),
        help='"layout,batch,ctx;..."',
    )
    ap.add_argument(
        "--prefill-list",
        default="",
        help='prefill chunks timed like the decode cases: "layout,chunk,prefix;...", e.g. '
        '"9q/3kv/64,2048,0;32q/8kv/128,1024,3072"',
    )
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument(
        "--device-times",
        action="store_true",
        help="also each form's kernel device time per call, from a profiler trace (the time per "
        "call includes the call's small XLA programs)",
    )
    ap.add_argument(
        "--convert-early",
        action="store_true",
        help="a third decode form: fp8 pages converted off the critical path "
        "(tuning.fp8_convert_early)",
    )
    ap.add_argument(
        "--fp8-tunings",
        default="",
        help='more fp8 decode forms, as attention_bench --decode-tunings plus the flag "early", '
        'e.g. "defaultxearly,128x4x1xwg2xpw4xearly"',
    )
    ap.add_argument("--dry", action="store_true", help="CPU syntax check: tiny shapes")
    args = ap.parse_args()
    num_ctas = getattr(jax.devices()[0], "core_count", None) or 132
    args.fp8_tunings = [  # parsed first: a typo fails before any work
        (spec, parse_tuning(spec, num_ctas)) for spec in filter(None, args.fp8_tunings.split(","))
    ]
    if args.dry:
        global CHECKS
        CHECKS = [("mixed", "9q/3kv/64", 32, [(1, 40), (1, 17), (30, 50), (0, 0)])]
        args.decode_list, args.reps, args.trials, args.alternations = "9q/3kv/64,4,64", 2, 1, 1
        args.prefill_list = "9q/3kv/64,40,24" if args.prefill_list else ""
    os.makedirs(args.out, exist_ok=True)
    log(kind="env", device=str(jax.devices()[0]), jax=jax.__version__, argv=sys.argv[1:])
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    if not args.skip_checks:
        run_checks(rng)
    ceil = measure_ceilings(args.trials, dry=args.dry)
    for kind, cases, run in (
        ("decode", args.decode_list, run_decode),
        ("prefill", args.prefill_list, run_prefill),
    ):
        for case in filter(None, cases.split(";")):
            layout, a, b = case.split(",")
            try:
                run(rng, ceil, args, layout, int(a), int(b))
            except Exception as e:  # noqa: BLE001
                log(kind=f"{kind}_error", layout=layout, case=case, error=str(e)[:400])
                traceback.print_exc()
    log(kind="wall", seconds=time.perf_counter() - t0)
    with open(os.path.join(args.out, "fp8_kv_check.json"), "w") as f:
        json.dump(ROWS, f, indent=1)
    print_table(ceil)


if __name__ == "__main__":
    main()
