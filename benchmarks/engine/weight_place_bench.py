"""How fast kernels go onto the device and back, without a model or an engine: the float kernels
of two Llama-3.1-8B layers (q/k/v, o, gate/up, down; bf16, 0.87 GB).

    python benchmarks/engine/weight_place_bench.py

In: `place_prepared` as loading and `update_weights` run it (each kernel a transposed view of the
checkpoint's [out, in], which the runtime copies row-major on the host as it transfers it), four
times. Out: each kernel back in the checkpoint's layout as `get_weights` makes it
(`export.host_transposed`: transposed on the device in blocks, then copied) against numpy's
transpose of the copied [in, out] array, three times each. Every array is checked.
"""

from __future__ import annotations

import time

import jax
import ml_dtypes
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from nori_jax.weights.export import host_transposed
from nori_jax.weights.loader import PreparedTensor, place_prepared

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
SPECS = {"qkv": P(None, "model"), "o": P("model", None), "gate_up": P(None, "model")}
LAYERS = 2


def main() -> None:
    mesh = Mesh(np.array(jax.devices()[:1]), ("model",))
    rng = np.random.default_rng(0)
    tensors = []
    for layer in range(LAYERS):
        for name, (fan_in, fan_out) in SHAPES.items():
            hf = rng.standard_normal((fan_out, fan_in), np.float32).astype(ml_dtypes.bfloat16)
            tensors.append(PreparedTensor(name, {(layer, name): hf.T.astype(hf.dtype)}))
    shardings = {
        (layer, name): NamedSharding(mesh, SPECS.get(name, P("model", None)))
        for layer in range(LAYERS)
        for name in SHAPES
    }
    nbytes = sum(v.nbytes for t in tensors for v in t.values.values())
    print(jax.devices()[0].device_kind)
    for rep in range(4):
        start = time.perf_counter()
        placed = {}
        for tensor in tensors:
            placed.update(place_prepared(tensor, shardings, None))
        jax.block_until_ready(placed)
        seconds = time.perf_counter() - start
        rate = nbytes / seconds / 1e9
        print(f"repeat {rep}: {seconds:.3f} s, {rate:.2f} GB/s of {nbytes / 1e9:.2f} GB")
    for tensor in tensors:
        ((path, host),) = tensor.values.items()
        assert np.array_equal(np.asarray(placed[path]), host), path
    print("every array as prepared")
    ways = {
        "out, transposed on the device": host_transposed,
        "out, transposed by numpy": lambda x: np.ascontiguousarray(np.asarray(x).T),
    }
    for rep in range(3):
        for way, export in ways.items():
            start = time.perf_counter()
            back = {path: export(x) for path, x in placed.items()}
            rate = nbytes / (time.perf_counter() - start) / 1e9
            print(f"repeat {rep}: {way}: {rate:.2f} GB/s")
            for tensor in tensors:
                ((path, host),) = tensor.values.items()
                assert np.array_equal(back[path], host.T), (way, path)


if __name__ == "__main__":
    main()
