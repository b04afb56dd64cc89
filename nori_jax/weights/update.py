"""New weights for a model already serving: an RL trainer's latest parameters, say, handed over
as Hugging Face-named tensors, as a checkpoint would hold them.

Two passes. `prepare_weights` runs the loader's own host path over them (`prepare_tensors`:
names mapped, q/k/v and gate/up fused, transposed, cast, every shape checked, every parameter
accounted for), so a bad set is refused before anything changes. `replace_weights` then puts
each prepared tensor on the device (quantized under the engine's `quantization`) on the sharding
of the array it replaces and swaps it in at once, so the old array is freed as the new one lands:
the device holds the weights plus one tensor, not two copies of the weights.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx

from nori_jax.weights.loader import (
    LoadedModel,
    PreparedTensor,
    place_prepared,
    prepare_tensors,
)

SOURCE = "update_weights"

Tensors = Mapping[str, Any] | Iterable[tuple[str, Any]]


def named_tensors(tensors: Tensors) -> dict[str, Any]:
    """The tensors by name; ValueError for a name given twice, or for anything but a mapping or
    (name, array) pairs of arrays (numpy, JAX, torch-on-CPU via `.numpy()`)."""
    if isinstance(tensors, Mapping):
        items = list(tensors.items())
    elif isinstance(tensors, (str, bytes)) or not isinstance(tensors, Iterable):
        raise ValueError(
            f"{SOURCE}: the weights must be a mapping of names to arrays, (name, array) pairs or "
            f"a Hugging Face directory's path, got {type(tensors).__name__}"
        )
    else:
        items = []
        for i, pair in enumerate(tensors):
            if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
                raise ValueError(f"{SOURCE}: item {i} is not a (name, array) pair: {pair!r:.80}")
            items.append(tuple(pair))
    named: dict[str, Any] = {}
    for name, array in items:
        if not isinstance(name, str):
            raise ValueError(f"{SOURCE}: a tensor's name must be a string, got {name!r:.80}")
        if name in named:
            raise ValueError(f"{SOURCE}: tensor {name!r} is given twice")
        if not hasattr(array, "__array__") or isinstance(array, (str, bytes)):
            raise ValueError(
                f"{SOURCE}: tensor {name!r} is a {type(array).__name__}, not an array (numpy, "
                "JAX, or torch's .numpy())"
            )
        named[name] = array
    return named


def prepare_weights(loaded: LoadedModel, tensors: Mapping[str, Any]) -> list[PreparedTensor]:
    """Every tensor laid out for `loaded`'s model on the host; ValueError naming the tensor for a
    name the model does not know or a shape it does not hold, or the parameters not given."""
    return list(
        prepare_tensors(
            ((name, _host(array)) for name, array in tensors.items()),
            loaded.state,
            SOURCE,
            num_kv_heads=loaded.config.num_kv_heads,
        )
    )


def replace_weights(loaded: LoadedModel, prepared: list[PreparedTensor]) -> None:
    """Swap each prepared tensor into `loaded.state`, placed on the sharding of the array it
    replaces, one tensor at a time (the caller holds no other reference to the old arrays).
    ValueError if a placed array's shape or dtype is not the old one's: what the compiled
    programs were built for (they take the parameters without jit's checks,
    executor/direct_call.py); the tensors before it are then already swapped."""
    flat = dict(nnx.to_flat_state(loaded.state))
    shardings = {path: var.get_value().sharding for path, var in flat.items()}
    placed = []
    for tensor in prepared:
        for path, array in place_prepared(tensor, shardings, loaded.quantization).items():
            check_like(path, array, flat[path].get_value())
            flat[path].set_value(array)
            placed.append(array)
    # Every transfer done when this returns: the prepared tensors may be the caller's own arrays
    # (prepare_tensors copies none whose dtype matches), which the caller may change next.
    jax.block_until_ready(placed)


def check_like(path: tuple, new: jax.Array, old: jax.Array) -> None:
    if new.shape != old.shape or new.dtype != old.dtype:
        where = ".".join(map(str, path))
        raise ValueError(
            f"{SOURCE}: {where} would be {new.dtype}{list(new.shape)}, the model holds "
            f"{old.dtype}{list(old.shape)}"
        )


def _host(array: Any) -> Any:
    """A tensor as the loader reads it: a device array comes to the host (the loader fuses and
    transposes on the host, then puts each result on its own sharding)."""
    return np.asarray(jax.device_get(array)) if isinstance(array, jax.Array) else array
