"""Speed of the quantized linear layers (models/linear.py) against bf16, on Llama-3.1-8B shapes.

    python benchmarks/kernels/quant_matmul_bench.py [--tokens 16,256,1024,4096] [--json out.json]

Each variant multiplies x[T, K] by L distinct weights of one shape in one jitted call (L chosen so
the weights exceed the 50 MB L2 and no dequantization can be hoisted or cached), timed in a stream
of calls with one wait (stream_timing.py: a wait after each call lets the GPU's clock drop), so
the time per matmul is device time with the launch amortized. Variants:

    bf16            x @ w[K, N], the float engine's kernel layout
    fp8             QuantizedLinear fp8: per-token quantization of x + fp8 x fp8 dot (f32 out)
    fp8 (x given)   the fp8 dot alone, x already fp8: what the per-token quantization costs
    int8            QuantizedLinear int8 as the engine runs it: the scale after the dot at up to
                    64 tokens (linear.SCALE_AFTER_DOT_MAX_TOKENS), else int8 fused
    int8 fused      dequantize (convert * scale) into the dot's operand, at every size
    int8 epilogue   (x @ convert(q)) * scale: the per-channel scale after the dot, at every size
    int8 mosaic     GPU only: JAX's own Hopper int8 x bf16 kernel (pallas.ops.gpu.
                    hopper_mixed_type_matmul_mgpu) on q[N, K] @ x^T, the scale after it: what a
                    Pallas kernel that dequantizes in registers gives before any tuning of ours
    int4 g128       QuantizedLinear int4, groups of 128
    int4 g32+off    the GGUF Q4_1 layout: groups of 32 and a float offset

Each variant compiles with the XLA options the engine gives its weights' mode
(executor/program_options.py: Triton's GEMM fusions off for fp8); `--default-xla-options`
compiles every variant with XLA's defaults instead (the engine's fp8 programs before 45f5b4d).

`lowering` names what XLA made of the dot (cuBLASLt fp8 gemm, a Triton gemm fusion that reads
the quantized weight, or a cuBLAS gemm fed by a separate dequantizing fusion, which writes the
bf16 weight to memory every call: where a Pallas kernel would pay). Prints one table; weight
TB/s counts the stored bytes of the weights (values + scales) read once per matmul.
"""

from __future__ import annotations

import argparse
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
from llama8b_shapes import CONTRACT_IN
from llama8b_shapes import SHAPES as LLAMA_8B
from stream_timing import time_stream

from nori_jax.executor import program_options
from nori_jax.models.linear import COLUMN, QuantizedLinear
from nori_jax.quantization.quantize import quantize_array, stored_bytes
from nori_jax.quantization.scheme import WeightQuantization, default_scheme

SHAPES = {
    name: LLAMA_8B[name]
    for name in ["qkv-q 4096x4096", "kv 4096x1024", "gate/up 4096x14336", "down 14336x4096"]
}


def _layers(scheme: WeightQuantization, k: int, n: int, count: int, key) -> list:
    out = []
    for i in range(count):
        w = 0.02 * jax.random.normal(jax.random.fold_in(key, i), (n, k), jnp.float32)
        layer = QuantizedLinear(k, n, jnp.bfloat16, COLUMN, scheme, f"w{i}")
        if scheme.offset:
            leaves = quantize_array(w, WeightQuantization("int4", scheme.group_size), jnp.bfloat16)
            leaves["offset"] = jnp.full(layer.offset.shape, 0.001, jnp.bfloat16)
        else:
            leaves = quantize_array(w, scheme, scheme.scale_dtype(jnp.bfloat16))
        for name, value in leaves.items():
            getattr(layer, name).set_value(value)
        out.append(layer)
    return out


def variants(k: int, n: int, count: int):
    """name -> (fn(x, weights) -> the outputs, weights, stored bytes of one weight, the weights'
    scheme or None). Outputs are returned, not summed: a sum would add a pass over every [T, N]
    output."""
    key = jax.random.key(0)
    bf16 = [
        (0.02 * jax.random.normal(jax.random.fold_in(key, i), (k, n), jnp.float32)).astype(
            jnp.bfloat16
        )
        for i in range(count)
    ]
    out = {"bf16": (lambda x, ws: [x @ w for w in ws], bf16, k * n * 2, None)}
    for name, scheme in (
        ("fp8", default_scheme("fp8")),
        ("int8", default_scheme("int8")),
        ("int4 g128", default_scheme("int4")),
        ("int4 g32+off", WeightQuantization("int4", 32, offset=True, source="bench")),
    ):
        layers = _layers(scheme, k, n, count, key)
        nbytes = stored_bytes([layers[0].qvalue.get_value(), layers[0].scale.get_value()])
        if scheme.offset:
            nbytes += stored_bytes([layers[0].offset.get_value()])
        out[name] = (lambda x, ws: [layer(x) for layer in ws], layers, nbytes, scheme)
        if name == "int8":
            out["int8 fused"] = (_int8_fused, layers, nbytes, scheme)
            out["int8 epilogue"] = (_int8_epilogue, layers, nbytes, scheme)
            if jax.default_backend() == "gpu":
                out["int8 mosaic"] = (_int8_mosaic, layers, nbytes, scheme)
        if name == "fp8":
            out["fp8 (x given)"] = (_fp8_given, layers, nbytes, scheme)
    return out


def _int8_fused(x, layers):
    return [jax.lax.dot_general(x, layer.weight().astype(x.dtype), CONTRACT_IN) for layer in layers]


def _int8_mosaic(x, layers):
    from jax.experimental.pallas.ops.gpu import hopper_mixed_type_matmul_mgpu as mixed

    t = x.shape[0]
    # wgmma's N is the token count here: one warpgroup per 64 output rows for a few tokens, the
    # two warpgroups side by side along the tokens for many
    if t < 128:
        cfg = mixed.TuningConfig(64, t, 128, 4, epi_tile_n=t, epi_tile_m=64,
                                 wg_dimension=mixed.MatmulDimension.M)  # fmt: skip
    else:
        # three stages: four of these tiles pass the H200's 227 KiB of shared memory
        cfg = mixed.TuningConfig(128, 64, 128, 3, wg_dimension=mixed.MatmulDimension.N)
    xt = x.T
    return [
        (
            mixed.mixed_matmul_kernel(layer.qvalue[...], xt, out_dtype=jnp.float32, config=cfg)
            * layer.scale[...]
        ).T.astype(x.dtype)
        for layer in layers
    ]


def _int8_epilogue(x, layers):
    return [
        jax.lax.dot_general(x, layer.qvalue[...].astype(x.dtype), CONTRACT_IN)
        * layer.scale[...][:, 0].astype(x.dtype)
        for layer in layers
    ]


def _fp8_given(x, layers):
    xq = x.astype(jnp.float8_e4m3fn)  # one convert of x, shared by every dot
    out = []
    for layer in layers:
        y = jax.lax.dot_general(
            xq, layer.qvalue[...], CONTRACT_IN, preferred_element_type=jnp.float32
        )
        out.append((y * layer.scale[...][:, 0]).astype(x.dtype))
    return out


def lowering(hlo: str) -> str:
    """What XLA made of the dots in an optimized HLO module."""
    kinds = []
    if "__cublas$lt$matmul$f8" in hlo:
        kinds.append("cublasLt-f8")
    if re.search(r"__triton_gemm|\"kind\":\"__triton", hlo):
        kinds.append("triton-gemm")
    if "__cublas$gemm" in hlo or re.search(r"__cublas\$lt\$matmul\"", hlo):
        kinds.append("cublas")
    if re.search(r"__cudnn\$fusion|__cudnn", hlo):
        kinds.append("cudnn")
    if not kinds:
        kinds.append("other")
    # A dequantizing fusion feeding a cuBLAS gemm materializes the bf16 weight.
    dequant = r"bf16\[\d+,\d+\]\{[^}]*\} fusion\([^)]*(s8|s4|f8e4m3fn)\[[^)]*\), kind=kLoop"
    if "cublas" in kinds and re.search(dequant, hlo):
        kinds.append("+dequant-fusion")
    return ",".join(kinds)


def compiled(fn, x, ws, scheme, default_options: bool):
    """`fn` compiled for (x, ws) with the engine's XLA options for `scheme` (or XLA's defaults)."""
    options = {} if default_options else program_options.for_weights(scheme)
    return jax.jit(fn).lower(x, ws).compile(compiler_options=options)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="16,256,1024,4096")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="names from SHAPES, comma-separated")
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--default-xla-options",
        action="store_true",
        help="compile every variant with XLA's defaults, not the engine's options for its mode",
    )
    args = ap.parse_args()
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
    rows = []
    for shape in args.shapes.split(","):
        k, n = SHAPES[shape]
        count = max(2, int(np.ceil(200e6 / (k * n * 2))))  # > 200 MB of bf16 weights per call
        vs = variants(k, n, count)
        for t in (int(s) for s in args.tokens.split(",")):
            x = (jax.random.normal(jax.random.key(t), (t, k), jnp.float32)).astype(jnp.bfloat16)
            base = None
            for name, (fn, ws, nbytes, scheme) in vs.items():
                try:
                    exe = compiled(fn, x, ws, scheme, args.default_xla_options)
                except Exception as e:  # noqa: BLE001 - a variant that cannot run is a row too
                    print(f"{shape:20s} T={t:5d} {name:14s} failed: {str(e)[:200]}", flush=True)
                    continue
                hlo = exe.as_text()
                sec = time_stream(exe, x, ws) / count
                base = sec if name == "bf16" else base
                rows.append(
                    dict(
                        shape=shape,
                        tokens=t,
                        variant=name,
                        us=sec * 1e6,
                        tflops=2 * t * k * n / sec / 1e12,
                        weight_tbps=nbytes / sec / 1e12,
                        vs_bf16=base / sec,
                        lowering=lowering(hlo),
                    )
                )
                r = rows[-1]
                print(
                    f"{shape:20s} T={t:5d} {name:14s} {r['us']:9.1f} us "
                    f"{r['tflops']:7.1f} TFLOP/s {r['weight_tbps']:5.2f} TB/s "
                    f"x{r['vs_bf16']:.2f} vs bf16  {r['lowering']}",
                    flush=True,
                )
                if args.json:  # after every row: a run stopped by a timeout keeps what it has
                    with open(args.json, "w") as f:
                        json.dump(rows, f, indent=1)
    print("\n| shape | T | variant | us | TFLOP/s | weight TB/s | vs bf16 | lowering |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['shape']} | {r['tokens']} | {r['variant']} | {r['us']:.1f} | "
            f"{r['tflops']:.1f} | {r['weight_tbps']:.2f} | {r['vs_bf16']:.2f} | {r['lowering']} |"
        )


if __name__ == "__main__":
    main()
