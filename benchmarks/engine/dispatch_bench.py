"""What a launch costs on the host, and whether stacking the layers' weights costs device time.

    python benchmarks/engine/dispatch_bench.py [--json F]

Part 1, dispatch: one compiled program of N small inputs (D of them donated and returned), called
200 times back to back; host microseconds per call (the loop without its final wait) for
N = 8 / 40 / 305 and D = 0 / 30. The forward pass of the SmolLM2-135M shape had 272 parameter
arrays and 30 donated KV arrays when this was written (122 parameter arrays since q/k/v and
gate/up are fused and the norm scales stacked): if the per-buffer cost is what bounds a launch,
this shows it.
Each case is timed twice, alternating: through `jax.stages.Compiled` (JAX's dispatcher) and
through the runner's direct call of the executable (nori_jax/executor/direct_call.py).
(`--parts dispatch` runs this part alone.)

Part 2, weight layouts: a decoder-shaped chain of matmuls (per layer: norm, q/k/v/o, gate/up/down,
plus a KV-row write into a donated page array) over the 135M and 1B shapes, with the weights
  separate   one array per weight per layer (what the engine does today),
  stacked    one [L, ...] array per weight kind, sliced with static indices in an unrolled loop,
  dynamic    the same stacked arrays, each layer's row taken at an index read from an int32[L]
             argument: every layer's slice-and-matmul is then the same HLO, so XLA:GPU autotunes
             each GEMM shape once, not once per layer (stacked static slices made the engine's
             compile run for minutes on the H200),
  scan       the same stacked arrays under lax.scan over the layers,
and the KV pages either per layer (separate) or one stacked [L, ...] array. Reports device time
per call (median of calls each waited on), the host time per call when pipelined, how many copy
and dynamic-slice instructions and copy-like loop fusions XLA left in the optimized program (each
counted wherever it stands, fused or not: a stacked weight that XLA copies before its matmul
shows up there, and as device time), the seconds its compile took, and how XLA ran its matmuls
(Triton GEMM fusions, cuBLAS calls).
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from nori_jax.executor.direct_call import DirectCall

SHAPES = {  # layers, hidden, q width, kv width, mlp width
    "135m": (30, 576, 576, 192, 1536),
    "1b": (16, 2048, 2048, 512, 8192),
}
KINDS = ("ln1", "q", "k", "v", "o", "ln2", "gate", "up", "down")


def dispatch_cost(n: int, donated: int, calls: int = 200, direct: bool = False) -> float:
    def f(*xs):
        keep = [x + 1 for x in xs[n - donated :]]
        return sum(x[0] for x in xs[: n - donated]) if n > donated else xs[0][0], keep

    fn = jax.jit(f, donate_argnums=tuple(range(n - donated, n)))
    xs = [jnp.full((256,), i, jnp.float32) for i in range(n)]
    exe = fn.lower(*xs).compile()
    if direct:
        call = DirectCall(exe)
        assert call.direct

        def exe(*args):  # noqa: F811 (the same program, called directly)
            out = call(list(args))
            return out[0], out[1:]

    kept, donor = xs[: n - donated], xs[n - donated :]
    for _ in range(20):
        _, donor = exe(*kept, *donor)
    jax.block_until_ready(donor)
    t0 = time.perf_counter()
    for _ in range(calls):
        out, donor = exe(*kept, *donor)
    t1 = time.perf_counter()
    jax.block_until_ready((out, donor))
    return (t1 - t0) / calls * 1e6


def weights(shape, layout, key):
    layers, h, q, kv, f = shape
    dims = {
        "ln1": (h,),
        "q": (h, q),
        "k": (h, kv),
        "v": (h, kv),
        "o": (q, h),
        "ln2": (h,),
        "gate": (h, f),
        "up": (h, f),
        "down": (f, h),
    }
    out = {}
    for i, kind in enumerate(KINDS):
        k = jax.random.fold_in(key, i)
        full = (0.02 * jax.random.normal(k, (layers, *dims[kind]), jnp.float32)).astype(
            jnp.bfloat16
        )
        out[kind] = full if layout != "separate" else [full[j] for j in range(layers)]
    return out


def layer(x, w, pages, slots):
    def norm(y, g):
        y32 = y.astype(jnp.float32)
        return (y32 * jax.lax.rsqrt(jnp.mean(y32 * y32, -1, keepdims=True) + 1e-5)).astype(
            y.dtype
        ) * g

    a = norm(x, w["ln1"])
    q, k, v = a @ w["q"], a @ w["k"], a @ w["v"]
    pages = pages.at[slots].set(k + v)  # the KV write: rows into the page array
    x = x + (q * jax.nn.sigmoid(q)) @ w["o"]
    b = norm(x, w["ln2"])
    return x + (jax.nn.silu(b @ w["gate"]) * (b @ w["up"])) @ w["down"], pages


def forward(layout, kv_layout, ws, kv, x, slots, layer_ids=None):
    layers = len(kv) if kv_layout == "separate" else kv.shape[0]
    if layout == "scan":
        assert kv_layout == "stacked"

        def body(x, wk):
            w, pages = wk
            x, pages = layer(x, w, pages, slots)
            return x, pages

        x, kv = jax.lax.scan(body, x, (ws, kv))
        return x.sum(), kv
    new = []
    for i in range(layers):
        if layout == "dynamic":  # the row at a runtime index: no constant for XLA to fold
            w = {k: jax.lax.dynamic_index_in_dim(v, layer_ids[i], 0, False) for k, v in ws.items()}
        else:
            w = {k: v[i] for k, v in ws.items()}
        pages = kv[i]
        x, pages = layer(x, w, pages, slots)
        if kv_layout == "separate":
            new.append(pages)
        else:
            kv = kv.at[i].set(pages)
    return x.sum(), (new if kv_layout == "separate" else kv)


def layout_case(shape_name, layout, kv_layout, tokens, pages_rows, calls=40):
    shape = SHAPES[shape_name]
    layers, h, q, kv, f = shape
    key = jax.random.key(0)
    ws = weights(shape, layout, key)
    kv_shape = (pages_rows, kv)
    if kv_layout == "separate":
        kvs = [jnp.zeros(kv_shape, jnp.bfloat16) for _ in range(layers)]
    else:
        kvs = jnp.zeros((layers, *kv_shape), jnp.bfloat16)
    x = (0.1 * jax.random.normal(jax.random.fold_in(key, 99), (tokens, h))).astype(jnp.bfloat16)
    slots = jnp.asarray(np.random.default_rng(0).permutation(pages_rows)[:tokens], jnp.int32)
    ids = jnp.arange(layers, dtype=jnp.int32) if layout == "dynamic" else None
    fn = jax.jit(functools.partial(forward, layout, kv_layout), donate_argnums=(1,))
    t0 = time.perf_counter()
    exe = fn.lower(ws, kvs, x, slots, ids).compile()
    compile_s = time.perf_counter() - t0
    hlo = exe.as_text()
    copies = len(re.findall(r"^\s*\S+ = \S+ copy\(", hlo, re.M))
    dynamic_slices = len(re.findall(r"^\s*\S+ = \S+ dynamic-slice\(", hlo, re.M))
    copy_fusions = len(re.findall(r"kind=kLoop, calls=%?[\w.]*(?:copy|slice)", hlo))
    # "__triton_gemm" in older XLA, "__triton_nested_gemm_fusion" in jax 0.11.2's (which counted
    # 0 under the first pattern on an H100, thirty-seventh session)
    triton = len(re.findall(r'"kind":"__triton(?:_nested)?_gemm', hlo))
    cublas = len(re.findall(r'custom_call_target="__cublas', hlo))
    for _ in range(3):
        s, kvs = exe(ws, kvs, x, slots, ids)
    jax.block_until_ready(kvs)
    device = []
    for _ in range(calls):
        t0 = time.perf_counter()
        s, kvs = exe(ws, kvs, x, slots, ids)
        jax.block_until_ready(s)
        device.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(calls):
        s, kvs = exe(ws, kvs, x, slots, ids)
    t1 = time.perf_counter()
    jax.block_until_ready(kvs)
    pipelined = (time.perf_counter() - t0) / calls
    n_args = len(jax.tree.leaves((ws, kvs, x, slots, ids)))
    return {
        "shape": shape_name,
        "weights": layout,
        "kv": kv_layout,
        "tokens": tokens,
        "args": n_args,
        "call_ms": statistics.median(device) * 1e3,
        "pipelined_ms": pipelined * 1e3,
        "dispatch_us": (t1 - t0) / calls * 1e6,
        "copies": copies,
        "dynamic_slices": dynamic_slices,
        "copy_fusions": copy_fusions,
        "compile_s": compile_s,
        "triton_gemms": triton,
        "cublas_calls": cublas,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--tokens", default="64,1024")
    parser.add_argument("--shapes", default="135m,1b")
    parser.add_argument("--parts", default="dispatch,layout")
    args = parser.parse_args()
    print("backend:", jax.default_backend(), jax.devices()[0].device_kind)
    rows = []
    for n, d in [(8, 0), (40, 0), (305, 0), (40, 30), (305, 30)] * ("dispatch" in args.parts):
        for repeat in range(2):
            for direct in (False, True):
                us = dispatch_cost(n, d, direct=direct)
                rows.append(
                    {
                        "part": "dispatch",
                        "call": "direct" if direct else "Compiled",
                        "repeat": repeat,
                        "inputs": n,
                        "donated": d,
                        "us_per_call": us,
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
    for shape in args.shapes.split(",") if "layout" in args.parts else []:
        for t in [int(x) for x in args.tokens.split(",")]:
            for layout, kv_layout in [
                ("separate", "separate"),
                ("stacked", "separate"),
                ("dynamic", "separate"),
                ("stacked", "stacked"),
                ("scan", "stacked"),
                ("separate", "separate"),
            ]:
                try:
                    row = layout_case(shape, layout, kv_layout, t, pages_rows=65536)
                except Exception as e:  # a layout XLA cannot run is a result too
                    row = {"shape": shape, "weights": layout, "kv": kv_layout, "error": repr(e)}
                rows.append({"part": "layout", **row})
                print(json.dumps(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print("\n| inputs | donated | call | host us per call (two alternations) |\n|---|---|---|---|")
    dispatch = [r for r in rows if r["part"] == "dispatch"]
    for key in dict.fromkeys((r["inputs"], r["donated"], r["call"]) for r in dispatch):
        us = [r["us_per_call"] for r in dispatch if (r["inputs"], r["donated"], r["call"]) == key]
        print(f"| {key[0]} | {key[1]} | {key[2]} | {' / '.join(f'{u:.1f}' for u in us)} |")
    print(
        "\n| shape | tokens | weights | kv | args | call ms | pipelined ms | dispatch us | "
        "copies | dynamic slices | copy fusions | compile s | Triton GEMMs | cuBLAS calls |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    for r in rows:
        if r["part"] == "layout" and "error" not in r:
            print(
                f"| {r['shape']} | {r['tokens']} | {r['weights']} | {r['kv']} | {r['args']} | "
                f"{r['call_ms']:.3f} | {r['pipelined_ms']:.3f} | {r['dispatch_us']:.0f} | "
                f"{r['copies']} | {r['dynamic_slices']} | {r['copy_fusions']} | "
                f"{r['compile_s']:.1f} | {r['triton_gemms']} | {r['cublas_calls']} |"
            )
        elif r["part"] == "layout":
            print(f"| {r['shape']} | | {r['weights']} | {r['kv']} | error: {r['error'][:80]} |")


if __name__ == "__main__":
    main()
