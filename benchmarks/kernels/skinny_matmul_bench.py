"""The skinny matmul (pallas_kernels/skinny_matmul) against XLA's dot on the Llama-3.1-8B shapes.

For each weight shape and token count: XLA's bf16 dot (what the engine runs), the kernel on the
same bf16 weight stored [in, out], XLA's fp8 dot (cuBLASLt, the engine's fp8 mode with x already
quantized) and the kernel on the fp8 weight stored [out, in]; the kernel on a per-channel int8
weight; int4 in groups of 128 through XLA (the engine's dequantize-into-the-dot form) and through
the kernel (each group's product scaled inside); with `--sweep`, the kernel also under other
stage and split counts. Each row gives microseconds per weight, the weight's bytes
per second (the bound at these token counts: the H200 copies about 4.0-4.4 TB/s) and the largest
error against a float32 product relative to the output's largest magnitude.

    python benchmarks/kernels/skinny_matmul_bench.py --tokens 16,64,128,256 --sweep --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import qwix
from llama8b_shapes import CONTRACT_IN
from llama8b_shapes import SHAPES as LLAMA_8B
from stream_timing import time_each_call, time_stream

from nori_jax.executor import program_options
from nori_jax.quantization.scheme import default_scheme
from pallas_kernels import device_info
from pallas_kernels.skinny_matmul import SkinnyTuning, default_tuning, skinny_matmul

SHAPES = {
    name: LLAMA_8B[name]
    for name in ["qkv 4096x6144", "o 4096x4096", "gate/up 4096x14336", "down 14336x4096"]
}
FP8 = jnp.float8_e4m3fn
G4 = 128  # int4's default group


def sweep(base: SkinnyTuning) -> list[SkinnyTuning]:
    out = [base]
    for stages in (2, 4, 6):
        for splits in (base.splits, base.splits * 2):
            tn = dataclasses.replace(base, stages=stages, splits=splits)
            if tn not in out:
                out.append(tn)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="16,64,128,256")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="names from SHAPES, comma-separated")
    ap.add_argument("--sweep", action="store_true", help="also other stage / split counts")
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--per-call",
        action="store_true",
        help="time each call with a wait after it, not a stream (the GPU idles: its clock drops)",
    )
    args = ap.parse_args()
    timer = time_each_call if args.per_call else time_stream
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
    fp8_options = program_options.for_weights(default_scheme("fp8"))
    rows = []

    def row(shape, t, variant, sec, nbytes, err, tuning=None):
        rows.append(dict(shape=shape, tokens=t, variant=variant, us=sec * 1e6,
                         weight_tbps=nbytes / sec / 1e12, rel_err=err,
                         tuning=dataclasses.asdict(tuning) if tuning else None))  # fmt: skip
        tn = f"bk={tuning.block_k} stages={tuning.stages} splits={tuning.splits}" if tuning else ""
        print(f"{shape:20s} T={t:4d} {variant:12s} {sec * 1e6:8.1f} us {nbytes / sec / 1e12:5.2f} "
              f"TB/s err {err:.1e}  {tn}", flush=True)  # fmt: skip
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)

    for shape in args.shapes.split(","):
        k, n = SHAPES[shape]
        count = max(2, int(np.ceil(200e6 / (k * n * 2))))  # > 200 MB of bf16 weights per call
        key = jax.random.key(0)
        w32 = [0.02 * jax.random.normal(jax.random.fold_in(key, i), (k, n)) for i in range(count)]
        w16 = [w.astype(jnp.bfloat16) for w in w32]  # [in, out], as the engine stores a kernel
        w8 = [(w.T / 0.002).astype(FP8) for w in w32]  # [out, in], as the engine stores fp8
        wi8 = [jnp.clip(jnp.round(w.T / 0.0005), -127, 127).astype(jnp.int8) for w in w32]
        # int4 in groups of 128 inputs, scales [out, groups] as QuantizedLinear stores them
        si4 = [(jnp.abs(w.T).reshape(n, k // G4, G4).max(-1) / 7).astype(jnp.bfloat16) for w in w32]
        wi4 = [
            jnp.clip(jnp.round(w.T / jnp.repeat(sc.astype(jnp.float32), G4, 1)), -8, 7)
            .astype(jnp.int8)
            .astype(jnp.int4)
            for w, sc in zip(w32, si4, strict=True)
        ]
        for t in (int(s) for s in args.tokens.split(",")):
            x16 = jax.random.normal(jax.random.key(t), (t, k)).astype(jnp.bfloat16)
            x8 = x16.astype(FP8)
            exact16 = x16[None].astype(jnp.float32) @ w16[0].astype(jnp.float32)
            exact8 = x8.astype(jnp.float32) @ w8[0].astype(jnp.float32).T
            exact_i8 = x16.astype(jnp.float32) @ wi8[0].astype(jnp.float32).T
            deq4 = wi4[0].astype(jnp.float32) * jnp.repeat(si4[0].astype(jnp.float32), G4, 1)
            exact_i4 = x16.astype(jnp.float32) @ deq4.T

            def err(y, exact):
                return float(jnp.abs(y[0].astype(jnp.float32) - exact).max() / jnp.abs(exact).max())

            xla16 = jax.jit(lambda x, ws: [x @ w for w in ws]).lower(x16, w16).compile()
            row(shape, t, "xla bf16", timer(xla16, x16, w16) / count, k * n * 2,
                err(xla16(x16, w16), exact16))  # fmt: skip
            xla8 = (
                jax.jit(
                    lambda x, ws: [
                        jax.lax.dot_general(x, w, CONTRACT_IN, preferred_element_type=jnp.float32)
                        for w in ws
                    ]
                )
                .lower(x8, w8)
                .compile(compiler_options=fp8_options)
            )
            row(shape, t, "xla fp8", timer(xla8, x8, w8) / count, k * n,
                err(xla8(x8, w8), exact8))  # fmt: skip
            # The engine's int4 form on XLA (QuantizedLinear.weight: qwix dequantizes into the
            # dot's operand), and the kernel's.
            xla4 = jax.jit(
                lambda x, ws, ss: [
                    jax.lax.dot_general(
                        x, qwix.dequantize(qwix.QArray(w, sc, None, jnp.int4)), CONTRACT_IN
                    )
                    for w, sc in zip(ws, ss, strict=True)
                ]
            )
            row(shape, t, "xla int4 g128", timer(xla4, x16, wi4, si4) / count, k * n // 2,
                err(xla4(x16, wi4, si4), exact_i4))  # fmt: skip
            base4 = default_tuning(t, k, n, 0.5, device_info.num_sms(), 2, block_k=G4)
            for tn in sweep(base4) if args.sweep and t <= 128 else [base4]:
                try:
                    kern4 = jax.jit(
                        lambda x, ws, ss, tn=tn: [
                            skinny_matmul(x, w, sc, w_layout="out_in", tuning=tn)
                            for w, sc in zip(ws, ss, strict=True)
                        ]
                    )
                    row(shape, t, "kernel int4 g128", timer(kern4, x16, wi4, si4) / count,
                        k * n // 2, err(kern4(x16, wi4, si4), exact_i4), tn)  # fmt: skip
                except Exception as e:  # noqa: BLE001 - a tuning that cannot run is a row
                    print(f"{shape:20s} T={t:4d} kernel int4 {tn} failed: {str(e)[:300]}")
            for x, ws, layout, nbytes, exact, name in (
                (x16, w16, "in_out", k * n * 2, exact16, "kernel bf16"),
                (x8, w8, "out_in", k * n, exact8, "kernel fp8"),
                (x16, wi8, "out_in", k * n, exact_i8, "kernel int8"),
            ):
                base = default_tuning(
                    t, k, n, ws[0].dtype.itemsize, device_info.num_sms(), x.dtype.itemsize
                )
                for tn in sweep(base) if args.sweep and t <= 64 else [base]:
                    try:
                        fn = jax.jit(
                            lambda x, ws, tn=tn, layout=layout: [
                                skinny_matmul(x, w, w_layout=layout, tuning=tn) for w in ws
                            ]
                        )
                        sec = timer(fn, x, ws) / count
                        row(shape, t, name, sec, nbytes, err(fn(x, ws), exact), tn)
                    except Exception as e:  # noqa: BLE001 - a tuning that cannot run is a row
                        print(f"{shape:20s} T={t:4d} {name:12s} {tn} failed: {str(e)[:300]}")


if __name__ == "__main__":
    main()
