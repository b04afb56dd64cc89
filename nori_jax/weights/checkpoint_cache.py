"""An orbax-checkpoint cache of converted parameters.

Converting a checkpoint (GGUF dequantization, dtype casts, transposes) costs seconds to minutes
each start. The first load saves the converted parameters; later loads restore them straight onto
the target shardings. The cache key covers the source files' contents (a sha256 of each, computed
once per file and remembered), the engine dtype, the model configuration and the converter
version: any change makes a new entry, and copies of one model at different paths (two installs)
share one. `nori-jax cache clear` removes the entries.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path

import jax
import orbax.checkpoint as ocp
from flax import nnx

from nori_jax.cache_paths import param_cache_dir
from nori_jax.weights.file_digest import file_digest

logger = logging.getLogger(__name__)
# Bump when the conversion of any source changes what lands in the parameters (the GGUF reader
# has its own CONVERSION_VERSION, also part of the key).
CONVERTER_VERSION = 2  # 2: q/k/v and gate/up fused (models/fused_layout.py)


def cache_root() -> Path:
    return param_cache_dir()


def cache_key(source: Path, dtype, model_config: object) -> str:
    """The entry of `source` (a file or a checkpoint directory) converted to `dtype`."""
    # The weights files the loader reads (config.json enters through `model_config`); the
    # directory's own path does not matter, the names inside it do.
    files = sorted(source.glob("*.safetensors")) if source.is_dir() else [source]
    h = hashlib.sha256()
    for f in files:
        name = f.name if source.is_dir() else ""
        h.update(f"{name}|{file_digest(f, cache_root())}\n".encode())
    from nori_jax.weights.gguf import CONVERSION_VERSION as GGUF_VERSION

    h.update(f"{jax.numpy.dtype(dtype).name}|{CONVERTER_VERSION}|{GGUF_VERSION}|".encode())
    h.update(json.dumps(repr(model_config)).encode())
    return h.hexdigest()[:32]


def _flat(state: nnx.State) -> dict[str, jax.Array]:
    return {".".join(map(str, path)): var.get_value() for path, var in nnx.to_flat_state(state)}


def restore(
    key: str, abstract_state: nnx.State, shardings: dict[tuple, jax.sharding.Sharding]
) -> nnx.State | None:
    """The cached parameters placed on `shardings`; None if this key is not cached (or broken)."""
    path = cache_root() / key
    if not path.is_dir():  # entries appear by an atomic rename once complete
        return None
    flat = nnx.to_flat_state(abstract_state)
    target = {
        ".".join(map(str, p)): jax.ShapeDtypeStruct(
            v.get_value().shape, v.get_value().dtype, sharding=shardings[p]
        )
        for p, v in flat
    }
    try:
        restored = ocp.StandardCheckpointer().restore(path, target)
    except Exception as e:  # a half-written or incompatible entry: rebuild it
        logger.warning("parameter cache entry %s is unreadable (%s); converting again", path, e)
        shutil.rmtree(path, ignore_errors=True)
        return None
    for p, var in flat:
        var.set_value(restored[".".join(map(str, p))])
    return nnx.from_flat_state(flat)


def save(key: str, state: nnx.State) -> None:
    path = cache_root() / key
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp, _flat(state))
    checkpointer.wait_until_finished()
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)  # a crash mid-save leaves only the .tmp entry, never a bad cache hit
