"""One line per prefill row of an attention_bench.py log (its JSON lines): layout, chunk,
implementation, the kernel's device time and that of the call's other device ops (the plan's
small XLA ops, a split tile's merge; per step or per layer in an engine, docs/benchmarks.md),
the call's wall time, error and the tuning's distinguishing fields.
    python3 benchmarks/kernels/prefill_rows.py LOG"""

from __future__ import annotations

import json
import re
import sys


def describe(tuning: str) -> str:
    f = dict(re.findall(r"(\w+)=('?\w+'?)", tuning or ""))
    if not f:
        return ""
    t = f"{f.get('block_kv')}x{f.get('num_stages')} cw{f.get('compute_wgs')}"
    pil = f.get("prefill_interleave", "False").strip("'")
    t += {"True": " pil", "per_step": " pils"}.get(pil, "")
    t += " pp" * (f.get("pingpong") == "True") + f" ks{f.get('prefill_kv_splits')}"
    return t


def main(path: str) -> None:
    for line in open(path):
        if not line.startswith("{"):
            continue
        r = json.loads(line)
        if r.get("kind") != "prefill":
            continue
        k = r.get("kernel_ms")
        kernel_us = k * 1e3 if k else -1
        others_us = r["others_ms"] * 1e3 if "others_ms" in r else -1
        chunk = f"{r['chunk']}+{r['prefix']}" if r.get("prefix") else str(r["chunk"])
        print(
            f"{r['layout']:>12} {chunk:>9} {r['impl']:>5} kernel {kernel_us:7.1f} us"
            f" others {others_us:5.1f} us"
            f" call {r.get('ms', -1) * 1e3:7.1f} us err {r.get('err', -1):.1e}"
            f" {describe(r.get('tuning'))} {r.get('error', '')[:80]}"
        )


if __name__ == "__main__":
    main(sys.argv[1])
