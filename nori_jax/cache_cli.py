"""`nori-jax cache`: where the on-disk caches are, how big they are, and clearing them.

Two caches: XLA's compiled programs (one entry per bucket and shape) and the converted
parameters (one orbax checkpoint per model file and dtype, about 4 bytes per parameter at
float32). Neither is ever pruned by the engine; `clear` empties them.
"""

from __future__ import annotations

import argparse
import re
import shutil
from pathlib import Path

from nori_jax.cache_paths import compilation_cache_dir, param_cache_dir


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _caches_by_kind(args: argparse.Namespace) -> dict[str, tuple[str, Path]]:
    chosen = {
        "params": ("converted parameters", param_cache_dir()),
        "xla": ("XLA compilation cache", compilation_cache_dir(args.compilation_cache_dir)),
    }
    which = [k for k in chosen if getattr(args, k)] or list(chosen)
    return {k: chosen[k] for k in which}


def _caches(args: argparse.Namespace) -> dict[str, Path]:
    return dict(_caches_by_kind(args).values())


def run_info(args: argparse.Namespace) -> int:
    for what, path in _caches(args).items():
        if not path.is_dir():
            print(f"{what}: {path} (empty)")
            continue
        entries = [p for p in path.iterdir() if not p.name.startswith(".")]
        print(f"{what}: {path}: {len(entries)} entries, {_size(path) / 2**20:,.1f} MiB")
    return 0


# What each cache writes: XLA's entries (`<key>-cache`, and `<key>-atime` where it tracks use)
# and the converted parameters' checkpoints (a directory named by a 32-digit hex hash).
_XLA_ENTRY = re.compile(r".+-(cache|atime)")
_PARAMS_ENTRY = re.compile(r"[0-9a-f]{32}(\..+)?")  # with a writer's temporary suffix


def _is_entry(kind: str, entry: Path) -> bool:
    pattern = _XLA_ENTRY if kind == "xla" else _PARAMS_ENTRY
    return pattern.fullmatch(entry.name) is not None


def run_clear(args: argparse.Namespace) -> int:
    """Delete each cache's own entries, and nothing else: a `--compilation-cache-dir` that names
    another directory (`.`, a home directory) lost all of it to a whole-tree removal before.
    The directory itself stays (it may be a link to a larger disk)."""
    for kind, (what, path) in _caches_by_kind(args).items():
        if not path.is_dir():
            print(f"{what}: {path} is already empty")
            continue
        entries = [e for e in path.iterdir() if _is_entry(kind, e)]
        others = sum(1 for e in path.iterdir() if not _is_entry(kind, e))
        size = sum(_size(e) for e in entries)
        for entry in entries:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        kept = f"; kept {others} entries that are not the cache's own" if others else ""
        print(f"{what}: removed {len(entries)} entries from {path} ({size / 2**20:,.1f} MiB){kept}")
    return 0


def add_cache_args(p: argparse.ArgumentParser) -> None:
    p.description = __doc__.split("\n\n")[1].replace("\n", " ")
    sub = p.add_subparsers(dest="cache_command", required=True)
    for name, func, help_text in (
        ("info", run_info, "print each cache's path, entries and size"),
        ("clear", run_clear, "delete the caches (both unless --params or --xla picks one)"),
    ):
        c = sub.add_parser(name, help=help_text, description=help_text)
        c.add_argument("--params", action="store_true", help="only the converted parameters")
        c.add_argument("--xla", action="store_true", help="only the XLA compilation cache")
        c.add_argument(
            "--compilation-cache-dir",
            default=None,
            help="the XLA cache a run used with this flag (default: $NORI_JAX_CACHE_DIR, "
            "else ~/.cache/nori_jax/xla)",
        )
        c.set_defaults(func=func)
