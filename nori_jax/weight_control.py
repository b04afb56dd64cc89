"""New weights, sleep and wake-up for a running engine, wherever its step loop runs.

`LLMEngine` (the offline `LLM`, the in-process server engine) and the engine-core process
(engine_core_process.py, what `nori-jax serve` runs) both hold an engine's parts and refuse
requests while it sleeps; this is the one implementation of what they do with them. The parts are
one engine's, or every replica's of a data-parallel mesh run in one process (ReplicatedEngine):
the replicas hold one model, so new weights are checked once on the host and then placed on each.

A swap needs the engine idle: requests queued or running raise `EngineBusyError` (HTTP 409), and
whatever step is still on the device is finished first by the caller's `drain`.

Importing this module loads no JAX (the API server process, which is JAX-free, raises and maps
its errors): the weight code is imported where an operation runs, in the engine's process.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nori_jax.weights.update import Tensors

logger = logging.getLogger(__name__)


class EngineBusyError(ValueError):
    """A weight swap, sleep or wake-up asked for while requests are queued or running."""


class EngineAsleepError(ValueError):
    """A request (or `update_weights`) sent to a sleeping engine: `wake_up` first."""


class WeightControl:
    """`update_weights`, `sleep` and `wake_up` over the parts `targets()` returns (EngineParts:
    `.model`, `.runner`, `.core`), for an engine that is idle when `busy()` is False and whose
    last step `drain()` finishes. `refused`: why this engine cannot swap at all (a multi-host or
    disaggregated one), or None."""

    def __init__(
        self,
        targets: Callable[[], list],
        busy: Callable[[], bool],
        drain: Callable[[], object],
        refused: str | None = None,
        metrics=None,
    ):
        self._targets, self._busy, self._drain, self._refused = targets, busy, drain, refused
        self._metrics = metrics  # EngineMetrics where this process has them (not the core's)
        self.asleep = False

    def _observe(self, op: str, new_weights: bool) -> None:
        if self._metrics is not None:
            self._metrics.observe_weight_op(op, self.asleep, new_weights)

    def check_awake(self, what: str = "the request") -> None:
        if self.asleep:
            raise EngineAsleepError(f"{what}: the engine is asleep (sleep()); wake_up() first")

    def update_weights(self, tensors: Tensors) -> None:
        """Serve with `tensors` (every parameter, Hugging Face-named; weights/update.py) from the
        next request on: checked on the host before any replica changes, then placed one tensor
        at a time; the prefix cache emptied. ValueError for a bad set (weights unchanged)."""
        if self.asleep:
            raise EngineAsleepError(
                "update_weights: the engine is asleep; wake_up(weights=...) takes new ones"
            )
        self._check_idle("update_weights")
        from nori_jax.weights.update import named_tensors, prepare_weights

        start = time.perf_counter()
        targets = self._targets()
        prepared = prepare_weights(targets[0].model, named_tensors(tensors))
        checked = time.perf_counter()
        for parts in targets:
            parts.runner.replace_weights(prepared)
            parts.core.scheduler.allocator.reset_prefix_cache()
        self._observe("update_weights", True)
        logger.info(
            "weights updated in %.2fs (%d tensors checked in %.2fs, placed on %d replica(s)); "
            "prefix cache emptied",
            time.perf_counter() - start,
            len(prepared),
            checked - start,
            len(targets),
        )

    def sleep(self, level: int = 1) -> None:
        """KV pages, step buffers and prefix cache freed; the weights to pinned host memory
        (level 1) or dropped (level 2). Returns once the device memory is free."""
        if isinstance(level, bool) or level not in (1, 2):
            raise ValueError(f"sleep level={level!r} must be 1 (weights kept) or 2 (dropped)")
        if self.asleep:
            raise ValueError("sleep: the engine is already asleep")
        self._check_idle("sleep")
        for parts in self._targets():
            parts.runner.sleep(keep_weights=level == 1)
            parts.core.scheduler.allocator.reset_prefix_cache()
        self.asleep = True
        self._observe("sleep", False)
        logger.info("asleep (level %d): KV pages and step buffers freed", level)

    def wake_up(self, weights: Tensors | None = None) -> None:
        """The kept weights back on the device, or `weights` placed there (checked on the host
        first), and fresh KV pages."""
        if not self.asleep:
            raise ValueError("wake_up: the engine is not asleep")
        from nori_jax.weights.residency import drop_weights
        from nori_jax.weights.update import named_tensors, prepare_weights

        start = time.perf_counter()
        targets = self._targets()
        if weights is not None:
            prepared = prepare_weights(targets[0].model, named_tensors(weights))
            for parts in targets:
                drop_weights(parts.model)
                parts.runner.replace_weights(prepared)
        for parts in targets:
            parts.runner.wake_up()
        self.asleep = False
        self._observe("wake_up", weights is not None)
        logger.info("awake in %.2fs", time.perf_counter() - start)

    def _check_idle(self, what: str) -> None:
        if self._busy():
            raise EngineBusyError(
                f"{what}: requests are queued or running; call it between requests"
            )
        if self._refused is not None:
            raise ValueError(f"{what}: {self._refused}")
        self._drain()  # nothing may still be in flight on the old weights or pages


def swap_refusal(config) -> str | None:
    """Why an engine of `config` (EngineConfig) cannot swap its weights or sleep, or None."""
    if config.distributed.num_processes > 1 or config.mesh.disaggregated:
        return (
            "a multi-host or disaggregated engine holds its weights and pages in several places "
            "this call does not reach"
        )
    return None


def tensors_from(weights: Tensors | str | os.PathLike) -> Tensors:
    """Named tensors as given, or those of a Hugging Face directory of safetensors (read as the
    update consumes them)."""
    if not isinstance(weights, (str, os.PathLike)):
        return weights
    from nori_jax.weights.safetensors_dir import is_hf_dir, iter_safetensors

    shown = _shown(str(weights))
    try:
        path = Path(weights).expanduser()
        found = is_hf_dir(path)
    except (OSError, RuntimeError, ValueError) as e:  # too long, a NUL, an unknown ~user
        why = os.strerror(e.errno) if isinstance(e, OSError) and e.errno else str(e)
        raise ValueError(f"{shown} is not a readable path: {why}") from None
    if not found:
        raise ValueError(f"{shown} is not a Hugging Face directory (config.json)")
    return _read(iter_safetensors(path), shown)


def _read(tensors, shown: str):
    """The directory's tensors; a file that cannot be read (corrupt, truncated, unreadable) a
    ValueError naming the directory. The update reads every tensor before it changes anything,
    so this is the caller's error, with the weights as they were."""
    try:
        yield from tensors
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - safetensors' own error type, OSError
        raise ValueError(f"{shown}: cannot read its tensors: {type(e).__name__}: {e}") from None


def _shown(path: str, limit: int = 200) -> str:
    """A path for an error message: quoted, and cut if a client sent a very long one."""
    return repr(path[:limit]) + (f" (+{len(path) - limit} characters)" if len(path) > limit else "")


CONTROL_OPS = ("sleep", "wake_up", "update_weights", "is_sleeping")


def run_control(
    control: WeightControl, op: str, level: int = 1, model_path: str | None = None
) -> bool:
    """One weight operation as the server names it (`op` of CONTROL_OPS; `model_path` a Hugging
    Face directory: update_weights, and wake_up with new weights); whether the engine sleeps
    after it. Raises what the operation raises (EngineBusyError, EngineAsleepError,
    ValueError)."""
    if op not in CONTROL_OPS:
        raise ValueError(f"op={op!r} must be one of {CONTROL_OPS}")
    try:
        if op == "sleep":
            control.sleep(level)
        elif op == "wake_up":
            control.wake_up(None if model_path is None else tensors_from(model_path))
        elif op == "update_weights":
            if not model_path:
                raise ValueError("update_weights needs model_path (a Hugging Face directory)")
            control.update_weights(tensors_from(model_path))
    except OSError as e:  # a file of the directory unreadable: read before anything changed
        raise ValueError(f"{op}: {e.strerror or e} ({_shown(str(e.filename or ''))})") from None
    return control.asleep
