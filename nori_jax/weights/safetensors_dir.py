"""Hugging Face checkpoint directories: config.json plus single or index-sharded safetensors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jax
import numpy as np
from safetensors import safe_open


def is_hf_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def read_hf_config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [path / f for f in sorted(set(weight_map.values()))]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {str(path)!r}")
    for f in files:
        if not f.is_file():
            raise ValueError(f"safetensors index names {str(f)!r}, which does not exist")
    return files


def iter_safetensors(path: Path) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (name, host array) one tensor at a time, keeping only one in memory.

    The flax framework is used (on the CPU device) because safetensors' numpy reader rejects
    bfloat16; `np.asarray` then gives an ml_dtypes bfloat16 array without a copy through float32.
    """
    cpu = jax.local_devices(backend="cpu")[0]  # this process's (multi-host: not process 0's)
    for file in safetensors_files(path):
        with jax.default_device(cpu), safe_open(str(file), framework="flax") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, np.asarray(f.get_tensor(name))
