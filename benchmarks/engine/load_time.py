"""Load time of a checkpoint: converting it (cold parameter cache) against restoring the converted
parameters from the orbax cache (warm).

    python benchmarks/engine/load_time.py [--model PATH_OR_GGUF] [--dtype bfloat16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import jax


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--model", default=None, help="default: the embedded SmolLM2-135M-Instruct GGUF"
    )
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    os.environ["NORI_JAX_PARAM_CACHE"] = tempfile.mkdtemp(prefix="nori-param-cache-")
    from nori_jax.executor.mesh import make_mesh
    from nori_jax.mesh_config import MeshConfig
    from nori_jax.weights.loader import load_model

    mesh = make_mesh(MeshConfig())
    times = {"convert (no cache)": [], "convert + save": [], "restore (warm cache)": []}
    for _ in range(args.repeats):
        t = time.perf_counter()
        m = load_model(args.model, dtype=args.dtype, mesh=mesh, param_cache=False)
        jax.block_until_ready(jax.tree.leaves(m.state))
        times["convert (no cache)"].append(time.perf_counter() - t)
    t = time.perf_counter()
    m = load_model(args.model, dtype=args.dtype, mesh=mesh)
    times["convert + save"].append(time.perf_counter() - t)
    for _ in range(args.repeats):
        t = time.perf_counter()
        m = load_model(args.model, dtype=args.dtype, mesh=mesh)
        jax.block_until_ready(jax.tree.leaves(m.state))
        assert m.from_cache
        times["restore (warm cache)"].append(time.perf_counter() - t)
    print(f"{m.source} dtype={m.dtype} backend={jax.default_backend()}")
    for k, v in times.items():
        print(
            f"{k:<24} median {sorted(v)[len(v) // 2]:6.2f} s   ({', '.join(f'{x:.2f}' for x in v)})"
        )


if __name__ == "__main__":
    main()
