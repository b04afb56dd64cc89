"""Everything that configures an engine, in one frozen dataclass: YAML fills it, CLIs override.

The scheduler's settings are a nested `SchedulerConfig`, the mesh a nested `MeshConfig` and the
processes of a multi-host engine a nested `DistributedConfig`. Presets
and `LLM(...)` may name their fields flat (`max_num_seqs: 32`) or nested (`scheduler:` / `mesh:`
mappings); both land in the same place. `mesh` may also name a mesh preset (`mesh: tp2`, a name in
configs/mesh/ or a YAML path), and vLLM's `tensor_parallel_size` / `data_parallel_size` set the
mesh's `model` / `data` over the mesh given beside them. Each field's help line is the `--flag`
help as well.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from nori_jax.config_field import check_types, option
from nori_jax.core.scheduler_config import SchedulerConfig
from nori_jax.distributed_config import DistributedConfig
from nori_jax.executor.gpu_client import GPU_CLIENTS
from nori_jax.executor.xla_flags import COMMAND_BUFFER_UPDATES
from nori_jax.mesh_config import MeshConfig
from nori_jax.quantization.scheme import QUANTIZATION_MODES
from nori_jax.yaml_file import read_yaml
from pallas_kernels.page_constants import KV_CACHE_DTYPES

ENGINE_PRESET_DIR = Path(__file__).resolve().parent.parent / "configs" / "engine"
ATTENTION_BACKENDS = ("auto", "reference", "pallas")
QUANTIZED_MATMULS = ("auto", "xla", "pallas", "upcast")
DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "dummy", "safetensors", "gguf")
_NESTED = {"scheduler": SchedulerConfig, "mesh": MeshConfig, "distributed": DistributedConfig}
# vLLM's keyword names for the mesh's fields; they override the `mesh` of the same source.
MESH_ALIASES = {"tensor_parallel_size": "model", "data_parallel_size": "data"}


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    model: str | None = option(
        None,
        help="HF directory, .gguf file, or shape preset (with --load-format dummy); none: the "
        "embedded SmolLM2-135M-Instruct",
    )
    tokenizer: str | None = option(
        None, help="HF directory whose tokenizer.json replaces the model's own"
    )
    dtype: str = option(
        "auto", help="parameter dtype; auto: bfloat16 on GPU, float32 on CPU", choices=DTYPES
    )
    quantization: str | None = option(
        None,
        help="store the decoder's linear weights quantized: fp8 (fp8 matmuls), int8 / int4 "
        "(weight-only); a GGUF file's own Q8_0/Q4_0/Q4_1 blocks are kept (none: the dtype)",
        choices=QUANTIZATION_MODES,
    )
    quantized_matmul: str = option(
        "auto",
        help="quantized weights in calls of few tokens: xla (XLA's dot: cuBLASLt's fp8 GEMM, "
        "fused dequantization of int8 / int4), pallas (up to 128 tokens on the skinny-matmul "
        "kernel for fp8, int8 and int4 without offsets; one device per replica), upcast (fp8 "
        "weights weight-only up to 64 tokens: converted inside XLA's GEMM fusion, the "
        "activations not quantized; int8 / int4 as xla) or auto (upcast for fp8, pallas for "
        "int4 on a GPU with one device per replica, xla otherwise: on the H100 the 8B engine "
        "with fp8 weights ran 1.02-1.03x faster upcast and 0.98x on the kernel, with int4 "
        "weights 1.47x faster on the kernel, with int8 0.92x at 64 sequences)",
        choices=QUANTIZED_MATMULS,
        flags=("--quantized-matmul", "--fp8-matmul"),
    )
    kv_cache_dtype: str = option(
        "auto",
        help="KV page dtype: auto (the model's dtype) or 8-bit fp8 pages (fp8 = fp8_e4m3, "
        "fp8_e5m2), dequantized on the fly by the attention (scales 1.0 unless calibrated)",
        choices=KV_CACHE_DTYPES,
    )
    calculate_kv_scales: bool = option(
        False,
        help="fp8 pages: per-layer K and V scales measured by a calibration prefill at start-up "
        "(off: 1.0)",
    )
    load_format: str = option(
        "auto", help="weights format; dummy: random weights of a shape preset", choices=LOAD_FORMATS
    )
    seed: int = option(0, help="seed of dummy weights and of requests that bring none")
    param_cache: bool = option(
        True, help="keep converted parameters in the orbax cache (`nori-jax cache info`)"
    )
    # KV cache
    num_pages: int | None = option(None, help="KV pages; none: sized by --gpu-memory-utilization")
    gpu_memory_utilization: float = option(
        0.9, help="share of device memory for parameters and KV pages"
    )
    cpu_kv_cache_gib: float = option(
        1.0, help="KV budget on a CPU backend (GiB), where device memory is not reported"
    )
    # Execution
    attention_backend: str = option(
        "auto",
        help="auto: the Pallas kernel on GPU, the jnp reference elsewhere",
        choices=ATTENTION_BACKENDS,
    )
    attention_tuning: str | None = option(
        None,
        help="the Pallas attention kernel's schedule, TuningConfig fields set over the buckets' "
        "defaults, for trying a schedule on the whole engine: '[tokens<N: | tokens>=N:] "
        "field=value,...; ...', e.g. 'tokens<2048: prefill_interleave=per_step'; a combination "
        "a bucket cannot take fails at start-up, naming the bucket (docs/kernels.md, Trying a "
        "schedule on the engine)",
    )
    async_scheduling: bool = option(
        True,
        help="plan step N+1 while the device runs step N (outputs trail the device by one step)",
    )
    command_buffer_update: str = option(
        "auto",
        help="GPU: how XLA updates a step's CUDA graph between launches; skip_temp keeps the "
        "temporary buffer at a fixed address (XLA's VMM allocator) and skips most updates "
        "(host dispatch 2.8 -> 1.0 ms at 64 sequences on an H200; docs/benchmarks.md); auto: "
        "skip_temp unless XLA_FLAGS names a mode or JAX started before the engine",
        choices=COMMAND_BUFFER_UPDATES,
    )
    gpu_client: str = option(
        "auto",
        help="GPU: which of XLA's runtimes runs the engine; tfrt: XLA's TFRT GPU client, whose "
        "launch costs less host time (a 16-sequence decode step's launch 0.54 against 1.51 ms on "
        "an H100; docs/benchmarks.md); auto: tfrt for an engine on one GPU with bf16/float32 "
        "weights and pages, the default client elsewhere (not yet measured with tfrt: several "
        "GPUs, quantized weights, fp8 pages), unless XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT is "
        "set or JAX started before the engine",
        choices=GPU_CLIENTS,
    )
    stack_weights: bool = option(
        False,
        help="pass the weight matrices to the forward pass stacked by kind, each layer's row "
        "taken at a runtime index (7 parameter arguments instead of 122 on the 135M shape: "
        "fewer buffers per launch); the model's state then holds the stacked weights' shapes "
        "only. A trade, not a default: on an H100 the forward pass dispatches 0.03-0.29 ms "
        "faster at 16-64 sequences, but XLA keeps the rows' slices out of the matmuls, so "
        "device-bound steps run 2-5% longer and the 2,000-request offline run 1.5% slower (on "
        "a CPU 0.6x); docs/benchmarks.md, Stacked weights at a runtime row index",
    )
    compilation_cache_dir: str | None = option(
        None, help="XLA compilation cache; none: $NORI_JAX_CACHE_DIR or ~/.cache/nori_jax/xla"
    )
    scheduler: SchedulerConfig = option(
        help="batch shape, context, prefix caching, isolation, admission",
        default_factory=SchedulerConfig,
    )
    mesh: MeshConfig = option(help="the device mesh", default_factory=MeshConfig)
    distributed: DistributedConfig = option(
        help="one engine over several processes (multi-host)", default_factory=DistributedConfig
    )

    def __post_init__(self) -> None:
        check_types(self)
        if not 0 <= self.seed < 2**32:  # JAX's PRNG keeps 32 bits of it
            raise ValueError(f"seed={self.seed} must be in [0, 2**32)")
        if self.num_pages is not None and self.num_pages < 2:
            raise ValueError(f"num_pages={self.num_pages} must be >= 2 (page 0 is reserved)")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]"
            )
        if not 0.0 < self.cpu_kv_cache_gib < float("inf"):
            raise ValueError(f"cpu_kv_cache_gib={self.cpu_kv_cache_gib} must be > 0")
        for name, allowed in (
            ("attention_backend", ATTENTION_BACKENDS),
            ("dtype", DTYPES),
            ("load_format", LOAD_FORMATS),
            ("kv_cache_dtype", KV_CACHE_DTYPES),
            ("command_buffer_update", COMMAND_BUFFER_UPDATES),
            ("gpu_client", GPU_CLIENTS),
            ("quantized_matmul", QUANTIZED_MATMULS),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r} must be one of {allowed}")
        if self.attention_tuning is not None:
            if self.attention_backend == "reference":
                raise ValueError(
                    f"attention_tuning={self.attention_tuning!r} sets the Pallas attention "
                    "kernel's schedule; attention_backend='reference' has none"
                )
            # Imported here: the parser reads TuningConfig, whose module imports JAX, and a
            # config without the field (every --help) must not.
            from pallas_kernels.ragged_paged_attention.tuning_overrides import (
                parse_tuning_overrides,
            )

            parse_tuning_overrides(self.attention_tuning)  # ValueError naming what is wrong
        if self.calculate_kv_scales and self.kv_cache_dtype == "auto":
            raise ValueError(
                "calculate_kv_scales=True needs fp8 KV pages (kv_cache_dtype='auto' has no scales)"
            )
        for name, kind in _NESTED.items():
            if not isinstance(getattr(self, name), kind):
                raise ValueError(f"{name} must be a {kind.__name__}, got {getattr(self, name)!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_MODES:
            raise ValueError(
                f"quantization={self.quantization!r} must be None or one of {QUANTIZATION_MODES}"
            )
        if self.quantized_matmul in ("pallas", "upcast") and self.quantization is None:
            raise ValueError(
                f"quantized_matmul={self.quantized_matmul!r} chooses the matmul of quantized "
                "weights; quantization=None has none (set quantization='fp8', 'int8' or 'int4')"
            )
        if self.quantized_matmul == "pallas" and self.mesh.model > 1:
            raise ValueError(
                f"quantized_matmul='pallas' runs on one device per replica: the mesh splits the "
                f"model over {self.mesh.model} (tensor parallelism partitions XLA's dots, not a "
                "kernel's)"
            )

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> EngineConfig:
        """A preset (a path or a name in configs/engine/) with the non-None `overrides` (flat or
        nested field values) applied on top."""
        return cls.from_preset(path, {k: v for k, v in overrides.items() if v is not None})

    @classmethod
    def from_preset(cls, path: str | Path, given: dict[str, Any]) -> EngineConfig:
        """A preset with every value of `given` applied on top (None included: it overrides).

        The preset's own max_model_len is a cap, clamped to the model's limit; a max_model_len in
        `given` is taken as asked (an error if the model is shorter).
        """
        values = nested_values(read_preset(path), source=str(path))
        sched = values.setdefault("scheduler", {})
        if "max_model_len" in sched:
            sched.setdefault("clamp_max_model_len", True)
        given = nested_values(given, source="overrides")
        if "max_model_len" in given.get("scheduler", {}):
            sched.pop("clamp_max_model_len", None)
        return cls.from_dict(merge_values(values, given))

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> EngineConfig:
        """Build from flat or nested field values; ValueError naming unknown keys."""
        values = nested_values(values, source="engine config")
        for name, kind in _NESTED.items():
            if isinstance(values.get(name), dict):
                values[name] = kind(**values[name])
        return cls(**values)


def preset_names() -> list[str]:
    return sorted(p.stem for p in ENGINE_PRESET_DIR.glob("*.yaml"))


def read_preset(path: str | Path) -> dict[str, Any]:
    """The raw mapping of a preset: a YAML path, or a name in configs/engine/."""
    p = Path(path)
    if not p.is_file():
        p = ENGINE_PRESET_DIR / f"{path}.yaml"
    if not p.is_file():
        raise ValueError(
            f"engine config {str(path)!r} not found (neither a file nor one of {preset_names()})"
        )
    values = read_yaml(p) or {}
    if not isinstance(values, dict):
        raise ValueError(f"engine config {str(p)!r} must be a mapping of EngineConfig fields")
    return values


def nested_values(values: dict[str, Any], source: str) -> dict[str, Any]:
    """Flat keys of nested configs (`max_num_seqs`, ...) moved under their section.

    A section given as a dataclass becomes a dict; a key given both flat and nested in one source
    is ambiguous and an error, as is a key no config has.
    """
    top = {f.name for f in dataclasses.fields(EngineConfig)}
    out: dict[str, Any] = {}
    sections: dict[str, dict[str, Any]] = {}
    for name, kind in _NESTED.items():
        given = values.get(name)
        if name == "mesh" and isinstance(given, str | Path):
            given = MeshConfig.from_name(given)  # a preset: its name or YAML path
        if dataclasses.is_dataclass(given):
            given = dataclasses.asdict(given)
        if given is not None and not isinstance(given, dict):
            raise ValueError(f"{source}: {name} must be a mapping, got {given!r}")
        sections[name] = dict(given or {})
        known = {f.name for f in dataclasses.fields(kind)}
        unknown = sorted(set(sections[name]) - known)
        if unknown:
            raise ValueError(f"{source}: unknown {name} keys {unknown}")
    flat_owner = {f.name: "scheduler" for f in dataclasses.fields(SchedulerConfig)}
    unknown = []
    for key, value in values.items():
        if key in _NESTED:
            continue
        if key in MESH_ALIASES:
            sections["mesh"][MESH_ALIASES[key]] = value
        elif key in top:
            out[key] = value
        elif key in flat_owner:
            section = sections[flat_owner[key]]
            if key in section and section[key] != value:
                raise ValueError(
                    f"{source}: {key} given both flat ({value!r}) and under scheduler "
                    f"({section[key]!r})"
                )
            section[key] = value
        else:
            unknown.append(key)
    if unknown:
        raise ValueError(f"{source}: unknown engine config keys {sorted(unknown)}")
    out.update({name: s for name, s in sections.items() if s})
    return out


def merge_values(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Nested values of `override` over `base` (both from nested_values)."""
    merged = dict(base)
    for key, value in override.items():
        if key in _NESTED:
            merged[key] = {**merged.get(key, {}), **value}
        else:
            merged[key] = value
    return merged
