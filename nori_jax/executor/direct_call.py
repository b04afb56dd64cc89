"""A compiled program called through its loaded executable: half the launch's cost per argument.

The forward pass takes about 300 arguments (one per weight array, one per layer's KV pages, the
step's buffers). `jax.stages.Compiled.__call__` runs JAX's C++ dispatcher, which for every
argument builds and hashes a signature, checks its layout, dtype and sharding, then hands the
buffers to the runtime: on the CPU machine 0.39 us per argument, of which the runtime's own work
is 0.18 (docs/benchmarks.md, "Host costs"). The runner passes the same weight arrays every step
and step buffers of fixed shapes it made itself, so those checks can only pass; `DirectCall`
gives the flat argument list to the executable (`execute_sharded`) and wraps its outputs with the
program's own output handlers, which is what the dispatcher ends with. Outputs are the same
`jax.Array`s, donated inputs are consumed the same way.

What is skipped is a check, so a caller that passes an array of another dtype or shape of the
same byte size gets it reinterpreted, not an error: only the runner, whose arguments come from the
abstract values it compiled for, uses this.

It reads JAX internals (the project pins jax 0.11.2): `Compiled._executable.unsafe_call`
(`xla_executable`, `kept_var_idx`, `out_handler`) and `Compiled._params.const_args`. A program
that needs more than that (effects, host callbacks, mutable refs, constants passed as arguments,
or jax_debug_nans' output checks), or a JAX without those attributes, is called through
`Compiled` as before (`direct` False says so).
"""

from __future__ import annotations

import logging

import jax

logger = logging.getLogger(__name__)


class DirectCall:
    """`call(flat_args) -> flat outputs` for a compiled program whose arguments and outputs are
    arrays (in `compiled.in_tree` / `out_tree` leaf order)."""

    def __init__(self, compiled: jax.stages.Compiled):
        self.compiled = compiled
        self.num_args = compiled.in_tree.num_leaves
        self._exe = self._kept = self._handlers = None
        reason = _unsupported(compiled)
        if reason is None:
            unsafe = compiled._executable.unsafe_call
            kept = sorted(unsafe.kept_var_idx)
            self._exe = unsafe.xla_executable
            self._handlers = unsafe.out_handler.handlers
            self._kept = None if kept == list(range(self.num_args)) else kept
        else:
            logger.warning("calling %s through jax's dispatcher: %s", compiled, reason)

    @property
    def direct(self) -> bool:
        return self._exe is not None

    def __call__(self, flat: list[jax.Array]) -> list[jax.Array]:
        if len(flat) != self.num_args:
            raise ValueError(f"expected {self.num_args} arguments, got {len(flat)}")
        if self._exe is None or jax.config.jax_debug_nans or jax.config.jax_debug_infs:
            args, kwargs = jax.tree.unflatten(self.compiled.in_tree, flat)
            return jax.tree.leaves(self.compiled(*args, **kwargs))
        if self._kept is not None:  # arguments jit pruned as unused
            flat = [flat[i] for i in self._kept]
        return self._exe.execute_sharded(flat).consume_with_handlers(self._handlers)


def _unsupported(compiled: jax.stages.Compiled) -> str | None:
    """Why `compiled` must go through the dispatcher, or None."""
    try:
        unsafe = compiled._executable.unsafe_call
        checks = {
            "effects": unsafe.ordered_effects or unsafe.has_unordered_effects,
            "host callbacks": unsafe.has_host_callbacks,
            "mutable refs": unsafe.mut is not None,
            "constants passed as arguments": bool(compiled._params.const_args),
        }
        unsafe.xla_executable.execute_sharded  # noqa: B018 (the entry point exists)
        unsafe.out_handler.handlers  # noqa: B018
    except AttributeError as e:  # another JAX than the pinned one
        return f"this JAX has no {e.name!r} where 0.11.2 has it"
    found = [what for what, present in checks.items() if present]
    return f"the program has {', '.join(found)}" if found else None
