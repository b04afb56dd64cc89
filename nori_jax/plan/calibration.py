"""A calibration: the step-time model of one (model shape, dtype, KV dtype, device, mesh).

Stored as a small YAML file under configs/calibration/, written by `nori-jax plan calibrate`
(see docs/planning.md for the format). The planner never guesses a combination it has no file
for: asking for one is a ValueError that names what was asked, what is calibrated, and the
command that records it.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from nori_jax.config_field import check_types
from nori_jax.plan.core_io import CoreIO
from nori_jax.plan.step_model import HOST_STAGES, LinearModel, StepCosts
from nori_jax.yaml_file import read_yaml

CALIBRATION_DIR = Path(__file__).resolve().parent.parent.parent / "configs" / "calibration"
FORMAT_VERSION = 1
_DTYPE_ALIASES = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp32": "float32",
    "f32": "float32",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "float8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


def normalize_dtype(name: str) -> str:
    d = _DTYPE_ALIASES.get(name.lower(), name.lower())
    if d not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {name!r}; use one of {sorted(DTYPE_BYTES)} (or fp8, bf16)")
    return d


def device_slug(kind: str) -> str:
    """'NVIDIA H200' -> 'nvidia-h200': the device as file names and flags spell it."""
    return re.sub(r"[^a-z0-9]+", "-", kind.lower()).strip("-")


@dataclasses.dataclass(frozen=True)
class CalibrationKey:
    model: str  # shape preset name (configs/models/) or the model's name
    dtype: str  # of weights and activations
    kv_dtype: str  # of the KV pages
    device: str  # device_slug of the accelerator kind
    tp: int = 1  # devices on the mesh axis `model` of one replica

    def __post_init__(self) -> None:
        check_types(self, "key ")  # a file's value is whatever YAML read (dtype: 5, tp: 1.5)
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))
        object.__setattr__(self, "kv_dtype", normalize_dtype(self.kv_dtype))
        object.__setattr__(self, "device", device_slug(self.device))
        if not self.model or self.tp < 1:
            raise ValueError(f"a calibration key needs a model and tp >= 1, got {self}")

    def describe(self) -> str:
        return (
            f"model={self.model} dtype={self.dtype} kv_dtype={self.kv_dtype} "
            f"device={self.device} tp={self.tp}"
        )

    @property
    def filename(self) -> str:
        return f"{self.model}_{self.dtype}_kv-{self.kv_dtype}_{self.device}_tp{self.tp}.yaml"


@dataclasses.dataclass(frozen=True)
class CalibratedEngine:
    """The engine the profiles were recorded on: the simulator's defaults for every what-if."""

    page_size: int
    num_pages: int  # the KV pool, page 0 included
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    vocab_size: int
    kv_bytes_per_token: int  # all layers, K and V, over the whole mesh
    attention_backend: str = "auto"
    async_scheduling: bool = True

    def __post_init__(self) -> None:
        # A file's value is whatever YAML read: a string of pages failed deep in the simulator.
        check_types(self, "engine ")
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, int) and not isinstance(v, bool) and v < 1:
                raise ValueError(f"engine {f.name}={v} must be >= 1")

    @property
    def kv_pool_bytes(self) -> int:
        """Memory of the usable KV pages: what a what-if page size or KV dtype divides anew."""
        return (self.num_pages - 1) * self.page_size * self.kv_bytes_per_token


@dataclasses.dataclass(frozen=True)
class KVTransfer:
    """Cost of moving a request's KV between two engines (prefill -> decode): latency + bytes/bw."""

    bytes_per_s: float
    latency_s: float = 0.0
    path: str = "given"  # how it was measured ("device-device", "device-host-device", "given")

    def __post_init__(self) -> None:
        if not (self.bytes_per_s > 0 and math.isfinite(self.bytes_per_s)):
            raise ValueError(f"KV transfer bytes_per_s must be finite and > 0, got {self}")
        if not (self.latency_s >= 0 and math.isfinite(self.latency_s)):
            raise ValueError(f"KV transfer latency_s must be finite and >= 0, got {self}")

    def seconds(self, num_bytes: int) -> float:
        return self.latency_s + num_bytes / self.bytes_per_s


@dataclasses.dataclass(frozen=True)
class Calibration:
    key: CalibrationKey
    engine: CalibratedEngine
    costs: StepCosts
    # Per feature, the largest value the profiles held: beyond it the model extrapolates.
    feature_max: Mapping[str, float] = dataclasses.field(default_factory=dict)
    quality: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    source: str = ""  # how and where it was recorded
    derived: bool = False  # True: derived from published figures, not recorded by calibrate
    kv_transfer: KVTransfer | None = None
    check: Sequence[Mapping[str, Any]] = ()  # measured vs predicted wall times (calibrate)
    path: str | None = None  # the file it was read from
    # The engine-core process's send path per step, by number of API servers (core_io.py);
    # empty in files recorded before it was measured.
    core_io: Mapping[int, CoreIO] = dataclasses.field(default_factory=dict)

    def kv_pages(self, page_size: int, kv_dtype: str | None = None) -> int:
        """Pages (null page included) of the calibrated KV memory at another page size."""
        per_token = self.engine.kv_bytes_per_token
        if kv_dtype is not None and normalize_dtype(kv_dtype) != self.key.kv_dtype:
            raise ValueError(
                f"uncalibrated combination: {self.key.describe()} asked with kv_dtype={kv_dtype}"
            )
        return self.engine.kv_pool_bytes // (page_size * per_token) + 1

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "format": FORMAT_VERSION,
            "key": dataclasses.asdict(self.key),
            "source": self.source,
            "derived": self.derived,
            "engine": dataclasses.asdict(self.engine),
            "device_seconds": self.costs.device.to_dict(),
            "host_seconds": {s: getattr(self.costs, s).to_dict() for s in HOST_STAGES},
            "launch_wait": self.costs.launch_wait,
            "feature_max": dict(self.feature_max),
            "quality": dict(self.quality),
        }
        if self.kv_transfer is not None:
            d["kv_transfer"] = dataclasses.asdict(self.kv_transfer)
        if self.check:
            d["check"] = [dict(c) for c in self.check]
        if self.core_io:
            d["core_io"] = {n: dataclasses.asdict(io) for n, io in sorted(self.core_io.items())}
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], path: str | None = None) -> Calibration:
        where = path or "calibration"
        if not isinstance(d, Mapping):
            raise ValueError(f"{where}: not a calibration mapping")
        if d.get("format") != FORMAT_VERSION:
            raise ValueError(
                f"{where}: format {d.get('format')!r}; this planner reads {FORMAT_VERSION}"
            )
        try:
            key = CalibrationKey(**d["key"])
            engine = CalibratedEngine(**d["engine"])
            host = _section(d, "host_seconds")
            costs = StepCosts(
                device=LinearModel.from_dict(d["device_seconds"], "device_seconds"),
                **{
                    s: LinearModel.from_dict(host[s], f"host_seconds.{s}")
                    for s in HOST_STAGES
                    if s in host
                },
                launch_wait=float(d.get("launch_wait", 0.0)),
            )
            kv = _section(d, "kv_transfer")
            return cls(
                key=key,
                engine=engine,
                costs=costs,
                feature_max={k: float(v) for k, v in _section(d, "feature_max").items()},
                quality=_section(d, "quality"),
                source=str(d.get("source", "")),
                derived=bool(d.get("derived", False)),
                kv_transfer=KVTransfer(**kv) if kv else None,
                check=tuple(d.get("check") or ()),
                path=path,
                core_io={int(n): CoreIO(**io) for n, io in _section(d, "core_io").items()},
            )
        except KeyError as e:
            raise ValueError(f"{where}: missing key {e}") from None
        except (TypeError, ValueError) as e:  # a corrupt value: say which file has it
            raise ValueError(f"{where}: {e}") from None


def _section(d: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    """An optional mapping of the file, empty where absent; a list or a number there is corrupt
    (a list of host_seconds was read as none at all)."""
    value = d.get(name) or {}
    if not isinstance(value, Mapping):
        raise ValueError(f"{name}: expected a mapping, got {value!r:.80}")
    return value


def load_calibration(path: str | Path) -> Calibration:
    p = Path(path)
    if p.is_dir():
        raise ValueError(
            f"calibration file {str(path)!r} is a directory: give a YAML file, or the directory "
            "as --calibration-dir"
        )
    if not p.is_file():
        raise ValueError(f"calibration file {str(path)!r} not found")
    return Calibration.from_dict(read_yaml(p), str(p))


def save_calibration(cal: Calibration, path: str | Path, header: str = "") -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    comment = "".join(f"# {line}\n".replace("# \n", "#\n") for line in header.splitlines())
    p.write_text(comment + yaml.safe_dump(rounded(cal.to_dict()), sort_keys=False, width=100))
    return p


def rounded(x: Any, digits: int = 5) -> Any:
    """Floats to `digits` significant digits: a readable file, far finer than timing noise."""
    if isinstance(x, float):
        return float(f"{x:.{digits}g}")
    if isinstance(x, dict):
        return {k: rounded(v, digits) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [rounded(v, digits) for v in x]
    return x


def list_calibrations(directory: str | Path = CALIBRATION_DIR) -> list[Calibration]:
    d = Path(directory)
    return [load_calibration(p) for p in sorted(d.glob("*.yaml"))] if d.is_dir() else []


@dataclasses.dataclass(frozen=True)
class CalibrationQuery:
    """What the user asked for; None fields match anything."""

    model: str | None = None
    dtype: str | None = None
    kv_dtype: str | None = None
    device: str | None = None
    tp: int | None = None

    def matches(self, key: CalibrationKey) -> bool:
        return (
            (self.model is None or self.model == key.model)
            and (self.dtype is None or normalize_dtype(self.dtype) == key.dtype)
            and (self.kv_dtype is None or normalize_dtype(self.kv_dtype) == key.kv_dtype)
            and (self.device is None or device_slug(self.device) == key.device)
            and (self.tp is None or self.tp == key.tp)
        )

    def describe(self) -> str:
        asked = [f"{f.name}={v}" for f in dataclasses.fields(self) if (v := getattr(self, f.name))]
        return " ".join(asked) or "anything"


def _uncalibrated(query: CalibrationQuery, known: Sequence[Calibration], where: str) -> ValueError:
    have = "; ".join(c.key.describe() for c in known) or "none"
    model = query.model or "SHAPE"
    return ValueError(
        f"uncalibrated combination: {query.describe()} (calibrated in {where}: {have}). "
        f"Record one on that hardware with: nori-jax plan calibrate --config h200-throughput "
        f"--model {model}" + (f" --tp {query.tp}" if query.tp and query.tp > 1 else "")
    )


def find_calibrations(
    query: CalibrationQuery, path: str | Path | None = None, directory: str | Path = CALIBRATION_DIR
) -> list[Calibration]:
    """Every calibration matching `query`: the one file `path`, else those in `directory`.
    ValueError (an uncalibrated combination) when none matches."""
    if path is not None:
        cal = load_calibration(path)
        if not query.matches(cal.key):
            raise _uncalibrated(query, [cal], str(path))
        return [cal]
    known = list_calibrations(directory)
    found = [c for c in known if query.matches(c.key)]
    if not found:
        raise _uncalibrated(query, known, str(directory))
    return found


def find_calibration(
    query: CalibrationQuery, path: str | Path | None = None, directory: str | Path = CALIBRATION_DIR
) -> Calibration:
    """The one calibration matching `query`; ValueError when none or several do."""
    found = find_calibrations(query, path, directory)
    if len(found) > 1 and query.kv_dtype is None:
        # KV pages unnamed: the engine's default (kv_cache_dtype "auto") keeps them in the
        # weights' dtype, so that calibration answers where it is the one such
        in_dtype = [c for c in found if c.key.kv_dtype == c.key.dtype]
        if len(in_dtype) == 1:
            found = in_dtype
    if len(found) > 1:
        keys = "; ".join(c.key.describe() for c in found)
        raise ValueError(
            f"{len(found)} calibrations match {query.describe()} ({keys}): name --dtype, "
            "--kv-dtype, --device or --tp, or pass --calibration FILE"
        )
    return found[0]
