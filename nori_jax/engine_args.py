"""Command-line flags for an engine, one per field of EngineConfig and its nested configs.

Each flag comes from its field: the name (`max_num_seqs` -> `--max-num-seqs`, or the field's own
`flags`, vLLM's names where vLLM has the setting), the type, the choices and the help line, with
the default written into it. A flag left out is not set at all, so the preset (`--config`, else
the backend's default, engine_defaults.py) decides; a flag given always wins. Nothing here
imports JAX: `--help` stays fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Iterator
from typing import Any

from nori_jax.config_field import help_of
from nori_jax.core.scheduler_config import SchedulerConfig
from nori_jax.distributed_config import DistributedConfig
from nori_jax.engine_config import EngineConfig, preset_names, read_preset
from nori_jax.engine_defaults import CPU_PRESET
from nori_jax.mesh_config import MeshConfig, mesh_preset_names

_NONE_WORDS = ("none", "null")


@dataclasses.dataclass(frozen=True)
class EngineFlag:
    field: dataclasses.Field
    section: str | None  # None: an EngineConfig field; else the nested config it belongs to
    dest: str
    kind: Any  # the resolved type hint

    @property
    def flags(self) -> tuple[str, ...]:
        return self.field.metadata.get("flags") or ("--" + self.field.name.replace("_", "-"),)


def engine_flags() -> Iterator[EngineFlag]:
    """Every settable field: EngineConfig's own, then the scheduler's, the mesh's and the
    processes' (multi-host)."""
    sections: list[tuple[str | None, type]] = [
        (None, EngineConfig),
        ("scheduler", SchedulerConfig),
        ("mesh", MeshConfig),
        ("distributed", DistributedConfig),
    ]
    for section, cls in sections:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if section is None and f.name in ("scheduler", "mesh", "distributed"):
                continue
            # Scheduler fields keep their flat names (as in presets and LLM(...)); the mesh's
            # `model` would clash with EngineConfig.model.
            dest = f"{section}.{f.name}" if section in ("mesh", "distributed") else f.name
            yield EngineFlag(f, section, dest, hints[f.name])


def _default_of(flag: EngineFlag) -> Any:
    f = flag.field
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory()


def _shown(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def _cpu_preset_values() -> dict[str, Any]:
    """The CPU default preset's values by flag dest (flat names), for the help lines."""
    raw = read_preset(CPU_PRESET)
    values = {k: v for k, v in raw.items() if k not in ("scheduler", "mesh")}
    values.update(raw.get("scheduler") or {})
    values.update({f"mesh.{k}": v for k, v in (raw.get("mesh") or {}).items()})
    return values


def _optional(convert: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        return None if text.strip().lower() in _NONE_WORDS else convert(text)

    parse.__name__ = convert.__name__  # argparse names the type in its error messages
    return parse


def _help(flag: EngineFlag, cpu_values: dict[str, Any]) -> str:
    default = _default_of(flag)
    text = f"{help_of(flag.field)} (default: {_shown(default)}"
    if flag.dest in cpu_values and cpu_values[flag.dest] != default:
        text += f"; on a CPU, preset {CPU_PRESET!r}: {_shown(cpu_values[flag.dest])}"
    return (text + ")").replace("%", "%%")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "engine",
        "Every EngineConfig field (nori_jax/engine_config.py). Unset flags take the preset's "
        f"value: --config, else {CPU_PRESET!r} on a CPU and EngineConfig's defaults on a GPU.",
    )
    g.add_argument(
        "--config",
        default=None,
        help="engine preset: a YAML path or a name in configs/engine/ "
        f"({', '.join(preset_names())}); flags override it (default: {CPU_PRESET!r} on a CPU, "
        "EngineConfig's defaults on a GPU)",
    )
    g.add_argument(
        "--mesh",
        dest="mesh_preset",
        type=_mesh_preset,
        default=argparse.SUPPRESS,
        metavar="NAME_OR_PATH",
        help="mesh preset: a name in configs/mesh/ "
        f"({', '.join(mesh_preset_names())}) or a YAML path (docs/mesh.md); "
        "--tensor-parallel-size and the other mesh flags override it (default: the config's "
        "mesh, one device)",
    )
    cpu_values = _cpu_preset_values()
    for flag in engine_flags():
        kw: dict[str, Any] = dict(
            dest=flag.dest, default=argparse.SUPPRESS, help=_help(flag, cpu_values)
        )
        kind, optional = flag.kind, False
        if typing.get_origin(kind) in (typing.Union, types.UnionType):  # X | None
            kind, optional = next(a for a in typing.get_args(kind) if a is not type(None)), True
        if kind is bool:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = _optional(kind) if optional else kind
            kw["choices"] = flag.field.metadata.get("choices")
            if flag.section == "mesh":
                kw["metavar"] = "N"
        g.add_argument(*flag.flags, **kw)
    # Spelling of the flag before it was derived from async_scheduling.
    g.add_argument(
        "--sync-scheduling",
        dest="async_scheduling",
        action="store_false",
        default=argparse.SUPPRESS,
        help="same as --no-async-scheduling (default: off, steps overlap)",
    )


def _mesh_preset(name_or_path: str) -> MeshConfig:
    try:
        return MeshConfig.from_name(name_or_path)
    except ValueError as e:  # argparse names the flag and exits with status 2
        raise argparse.ArgumentTypeError(str(e)) from None


def engine_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The engine fields the command line set, nested as EngineConfig.from_dict takes them: a
    `--mesh` preset first, the per-field flags over it."""
    given: dict[str, Any] = {}
    if hasattr(args, "mesh_preset"):
        given["mesh"] = dataclasses.asdict(args.mesh_preset)
    for flag in engine_flags():
        if hasattr(args, flag.dest):
            value = getattr(args, flag.dest)
            if flag.section is None:
                given[flag.field.name] = value
            else:
                given.setdefault(flag.section, {})[flag.field.name] = value
    return given


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The preset (`--config`, else the backend's default) with the flags given on top."""
    from nori_jax.engine_defaults import resolve_engine_config

    return resolve_engine_config(getattr(args, "config", None), engine_overrides(args))
