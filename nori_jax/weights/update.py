"""New weights for a model already serving: an RL trainer's latest parameters, say, handed over
as Hugging Face-named tensors, as a checkpoint would hold them.

They go through the loader's own path (`place_tensors`: names mapped, q/k/v and gate/up fused,
linear layers quantized under the engine's `quantization`, each array put on its sharding), so
they land exactly as loading that checkpoint would have placed them, and every one is checked
against the array it replaces (shape, dtype, sharding): the compiled programs take the new arrays
without recompiling. Every parameter must be given, once. Nothing is replaced until all of them
are placed, so a bad tensor leaves the model as it was; until then both copies are on the
device (the engine's memory must leave room for a second copy of the weights).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh

from nori_jax.weights.loader import LoadedModel, place_tensors

SOURCE = "update_weights"

Tensors = Mapping[str, Any] | Iterable[tuple[str, Any]]


def named_tensors(tensors: Tensors) -> dict[str, Any]:
    """The tensors by name; ValueError for a name given twice."""
    if isinstance(tensors, Mapping):
        return dict(tensors)
    named: dict[str, Any] = {}
    for name, array in tensors:
        if name in named:
            raise ValueError(f"{SOURCE}: tensor {name!r} is given twice")
        named[name] = array
    return named


def placed_weights(loaded: LoadedModel, tensors: Mapping[str, Any], mesh: Mesh) -> nnx.State:
    """A new state for `loaded`'s model from HF-named host or device arrays (ValueError naming
    the tensor for a name the model does not know or a shape it does not hold, or the parameters
    not given). `loaded` itself is not changed."""
    items = tensors.items()
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), loaded.state
    )
    state = place_tensors(
        ((name, _host(array)) for name, array in items),
        abstract,
        mesh,
        SOURCE,
        loaded.quantization,
        num_kv_heads=loaded.config.num_kv_heads,
    )
    check_like(state, loaded.state)
    return state


def check_like(new: nnx.State, old: nnx.State) -> None:
    """ValueError unless every new array has its old one's shape, dtype and sharding (what the
    compiled programs were built for)."""
    old_flat = dict(nnx.to_flat_state(old))
    for path, var in nnx.to_flat_state(new):
        a, b = var.get_value(), old_flat[path].get_value()
        if (
            a.shape != b.shape
            or a.dtype != b.dtype
            or not a.sharding.is_equivalent_to(b.sharding, a.ndim)
        ):
            where = ".".join(map(str, path))
            raise ValueError(
                f"{SOURCE}: {where} would be {a.dtype}{list(a.shape)} on {a.sharding}, the "
                f"model holds {b.dtype}{list(b.shape)} on {b.sharding}"
            )


def _host(array: Any) -> Any:
    """A tensor as the loader reads it: a device array comes to the host (the loader fuses and
    transposes on the host, then puts each result on its own sharding)."""
    return jax.device_get(array) if isinstance(array, jax.Array) else array
