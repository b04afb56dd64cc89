"""Where a compute warpgroup's time goes: Mosaic GPU profiler spans of one attention call (GPU).

    PYTHONPATH=. python benchmarks/kernels/attention_profile.py --layout 32q/8kv/64 \
        --chunk 8192 --tunings default,defaultxcw2xpp --out DIR
    PYTHONPATH=. python benchmarks/kernels/attention_profile.py --layout 9q/3kv/64 \
        --decode 1024,1024 --page-size 64 --kv-dtype e4m3 --tunings default --out DIR

For each tuning (attention_bench.parse_tuning's specs) it runs one prefill chunk (or with `--decode
BATCH,CTX` one decode step; `--kv-dtype e4m3|e5m2`: on fp8 pages with calibrated scales) with
`profile_dir`, then prints, per warpgroup of a CTA, each span's share of that warpgroup's time
(first to last event), count and mean. Spans are mgpu_consumer's named scopes per KV block: wait_k
(K landed), qk (Q K^T issued and finished; with ping-pong, the rendezvous after the issue), softmax,
wait_v (V landed; with ping-pong, the hand-over), pv. Per item: wait_q (the item's Q landed),
load_q (Q into registers or its 8-bit tile), store_o (the output normalised, staged and stored, to
the stores' end) and, on a decode item's warpgroup that does not own it, skip (its blocks waited
for and released). Mosaic GPU adds `Init` (from the kernel's start to the end of its set-up). A
warpgroup records at most 1,024 spans per call, so long calls are summarised over their first
part. The producer records none.

Units: the profiler stamps each event with the SM's cycle counter (`%clock`) and places a
warpgroup's first event at that warpgroup's start on the global timer (ns), so a span's length and
a warpgroup's own timeline are in SM cycles, printed as kilocycles ("kcyc"); at the GPU's SM clock
(`--sm-clock-mhz`, default: nvidia-smi's maximum SM clock) they are also shown in us. Only the
CTAs' relative starts are in ns (the global timer's resolution).

`timeline`: per CTA, the first compute warpgroup's milestones from the start of Mosaic GPU's own
first span, `Init` (the kernel's start: barriers initialised): its first item's Q landed (end of
the first wait_q), its first K block landed (end of the first wait_k), its last event; median and
maximum over CTAs. On a short prefill chunk, where a CTA has one item, this is how long the
first copies take before any math (docs/benchmarks.md, "The first copies of a short chunk").

It also prints how the CTAs' work ends (`cta_ends`): each CTA's last event, from the first event
of the call, at the minimum, median and maximum over CTAs. The call takes the maximum; a median
well below it means CTAs sit idle at the end (uneven work, or too few items). Summaries of
truncated traces (some warpgroup hit the 1,024-span cap) say so: their ends are not the calls'.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import subprocess
import sys

import jax
import numpy as np

from pallas_kernels.ragged_paged_attention.pallas_attention import ragged_paged_attention_pallas
from pallas_kernels.ragged_paged_attention.tuning import default_tuning

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import attention_bench as ab  # noqa: E402
from fp8_kv_check import FP8, to_fp8  # noqa: E402


def summarize(trace: dict, warpgroups_per_cta: int) -> dict[tuple[int, str], dict]:
    """{(warpgroup, span): {share, count, mean_kcyc}} over every CTA of one Chrome trace (the
    profiler's: B/E events, tid = 1 + warpgroup + warpgroups_per_cta * cta; within a warpgroup
    ts advances by SM cycles / 1,000, module docstring)."""
    by_tid = collections.defaultdict(list)
    for e in trace["traceEvents"]:
        by_tid[e["tid"]].append(e)
    busy = collections.Counter()
    count = collections.Counter()
    span = collections.Counter()
    for tid, events in by_tid.items():
        wg = (tid - 1) % warpgroups_per_cta
        span[wg] += events[-1]["ts"] - events[0]["ts"]
        open_events = []
        for e in events:
            if e["ph"] == "B":
                open_events.append(e)
            else:
                b = open_events.pop()
                busy[(wg, b["name"])] += e["ts"] - b["ts"]
                count[(wg, b["name"])] += 1
    return {
        key: {
            "share": t / span[key[0]] if span[key[0]] else 0.0,
            "count": count[key],
            "mean_kcyc": t / count[key],
        }
        for key, t in sorted(busy.items())
    }


def cta_ends(trace: dict, warpgroups_per_cta: int) -> dict:
    """When the CTAs finish, from the call's first event: {min, median, max, truncated}. Each
    end is its CTA's start (global timer, us) plus its own SM kilocycles (module docstring): a
    mixed unit, read as a shape (median against max), not as a duration.

    truncated: some warpgroup recorded the profiler's 1,024-span cap (its end is not shown)."""
    first = min(e["ts"] for e in trace["traceEvents"])
    last = collections.defaultdict(float)
    spans = collections.Counter()
    for e in trace["traceEvents"]:
        last[(e["tid"] - 1) // warpgroups_per_cta] = max(
            last[(e["tid"] - 1) // warpgroups_per_cta], e["ts"]
        )
        spans[e["tid"]] += e["ph"] == "B"
    ends = np.array(sorted(last.values())) - first
    return {
        "min": float(ends[0]),
        "median": float(np.median(ends)),
        "max": float(ends[-1]),
        "truncated": max(spans.values()) >= 1024,
    }


def sm_clock_mhz() -> float | None:
    """The GPU's maximum SM clock from nvidia-smi (MHz), or None where it cannot be read."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=clocks.max.sm", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        return float(out.split()[0])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


MILESTONES = (("q", "wait_q"), ("k", "wait_k"))


def timeline(trace: dict, warpgroups_per_cta: int) -> dict[str, dict]:
    """Milestones of each CTA's first compute warpgroup, in SM kilocycles from its `Init` span:
    {milestone: {median, max, ctas}} for the end of its first wait_q ("q") and wait_k ("k") and
    its last event ("end"), over the CTAs that had work (a CTA without items records its Init
    span alone). ts of one warpgroup's events are its start (global timer) plus SM
    cycles / 1,000 (the profiler's), so differences within a warpgroup are kilocycles."""
    by_tid = collections.defaultdict(list)
    for e in trace["traceEvents"]:
        if (e["tid"] - 1) % warpgroups_per_cta == 0:
            by_tid[e["tid"]].append(e)
    marks = collections.defaultdict(list)
    for events in by_tid.values():
        if events[0]["name"] != "Init" or all(e["name"] == "Init" for e in events):
            continue
        t0 = events[0]["ts"]
        for key, name in MILESTONES:
            ends = [e["ts"] for e in events if e["name"] == name and e["ph"] == "E"]
            if ends:
                marks[key].append(ends[0] - t0)
        marks["end"].append(events[-1]["ts"] - t0)
    return {
        key: {"median": float(np.median(v)), "max": float(np.max(v)), "ctas": len(v)}
        for key, v in marks.items()
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", default="32q/8kv/64", choices=sorted(ab.LAYOUTS))
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--prefix", type=int, default=0)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--decode", default="", help='"BATCH,CTX": a decode step instead of a chunk')
    ap.add_argument("--kv-dtype", default="bf16", choices=["bf16", *FP8])
    ap.add_argument("--tunings", default="default")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--sm-clock-mhz", type=float, default=None, help="default: nvidia-smi's max")
    args = ap.parse_args()
    mhz = args.sm_clock_mhz or sm_clock_mhz()
    # kilocycles to us at the SM clock (None: unknown, kilocycles only)
    to_us = (lambda kc: f" ({kc * 1e3 / mhz:.2f} us)") if mhz else (lambda kc: "")
    print(f"SM clock for us: {mhz} MHz" if mhz else "SM clock unknown: kilocycles only")
    num_ctas = getattr(jax.devices()[0], "core_count", None) or 132
    hq, hkv, d = ab.LAYOUTS[args.layout]
    rng = np.random.default_rng(0)
    if args.decode:
        batch, ctx = (int(v) for v in args.decode.split(","))
        p, _, _ = ab.decode_case(rng, batch, ctx, args.layout, args.page_size, rotations=1)
        num_seqs, case = batch, f"decode {batch} x {ctx}"
    else:
        p = ab.prefill_case(rng, args.layout, args.chunk, args.prefix, args.page_size, rotations=1)
        num_seqs, case = p["tables"][0].shape[0], f"{args.chunk}+{args.prefix}"
    kv_dtype, extra = None, {}
    if args.kv_dtype in FP8:
        kv_dtype = FP8[args.kv_dtype]
        p["kv"], extra["kv_scales"] = to_fp8(p["kv"], kv_dtype)
    base = default_tuning(
        num_seqs=num_seqs,
        num_kv_heads=hkv,
        head_dim=d,
        page_size=args.page_size,
        pages_per_seq=p["tables"][0].shape[1],
        dtype=p["q"].dtype,
        num_ctas=num_ctas,
        num_tokens=p["q"].shape[0],
        num_q_heads=hq,
        kv_dtype=kv_dtype,
    )
    for spec in args.tunings.split(","):
        tuning = ab.parse_tuning(spec, num_ctas)(base)
        trace_dir = os.path.join(args.out, f"profile-{spec}")
        os.makedirs(trace_dir, exist_ok=True)
        for old in glob.glob(os.path.join(trace_dir, "*-trace.json")):
            os.remove(old)  # one trace per call: this run's is the only one
        out = ragged_paged_attention_pallas(
            *ab.step_args(p),
            sm_scale=d**-0.5,
            tuning=tuning,
            profile_dir=trace_dir,
            **extra,
        )
        jax.block_until_ready(out)
        (path,) = glob.glob(os.path.join(trace_dir, "*-trace.json"))
        with open(path) as f:
            trace = json.load(f)
        rows = summarize(trace, tuning.compute_wgs + 1)
        ends = cta_ends(trace, tuning.compute_wgs + 1)
        marks = timeline(trace, tuning.compute_wgs + 1)
        print(f"{args.layout} {case} page {args.page_size} {args.kv_dtype} {spec}: {tuning}")
        print(
            f"  CTA ends (start us + kilocycles, from the first event): min {ends['min']:.1f}"
            f"  median {ends['median']:.1f}  max {ends['max']:.1f}"
            + ("  (truncated: some warpgroup hit the span cap)" if ends["truncated"] else "")
        )
        for key, m in marks.items():
            print(
                f"  timeline {key:4s} median {m['median']:6.2f} kcyc{to_us(m['median'])}"
                f"  max {m['max']:6.2f} kcyc{to_us(m['max'])}  ({m['ctas']} CTAs)"
            )
        for (wg, name), row in rows.items():
            kc = row["mean_kcyc"]
            print(
                f"  wg{wg} {name:8s} {100 * row['share']:5.1f}%  n={row['count']:6d}"
                f"  mean={kc:7.3f} kcyc{to_us(kc)}"
            )
        with open(os.path.join(trace_dir, "summary.json"), "w") as f:
            json.dump(
                dict(
                    spans=[dict(wg=wg, span=name, **row) for (wg, name), row in rows.items()],
                    cta_ends=ends,
                    timeline_kcycles=marks,
                    sm_clock_mhz=mhz,
                ),
                f,
            )


if __name__ == "__main__":
    main()
