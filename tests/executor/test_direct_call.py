"""The launch's direct call of a compiled program (executor/direct_call.py) against JAX's own
call of it: the same outputs, donated arguments consumed, arguments jit pruned handled, and the
dispatcher kept where the program needs it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nori_jax.executor.direct_call import DirectCall


def _program(x, unused, pages, step):
    """`unused` is pruned by jit; `pages` (a list) is donated and comes back updated."""
    del unused
    new_pages = [p.at[step[0]].add(x.sum()) for p in pages]
    return (x * 2.0, step + 1), new_pages


def _args():
    x = jnp.arange(6, dtype=jnp.float32)
    unused = jnp.ones((3,), jnp.int32)
    pages = [jnp.full((4, 2), i, jnp.float32) for i in range(3)]
    return x, unused, pages, jnp.array([1], jnp.int32)


@pytest.fixture(scope="module")
def compiled():
    return jax.jit(_program, donate_argnums=(2,)).lower(*_args()).compile()


def test_outputs_equal_the_compiled_call_and_donated_pages_are_consumed(compiled):
    call = DirectCall(compiled)
    assert call.direct and call.num_args == 6
    expected = jax.tree.leaves(compiled(*_args()))
    args = _args()
    out = call(jax.tree.leaves(args))
    assert len(out) == len(expected) == 5
    for got, want in zip(out, expected, strict=True):
        assert isinstance(got, jax.Array) and got.sharding == want.sharding
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert all(p.is_deleted() for p in args[2])
    assert not args[0].is_deleted() and not args[1].is_deleted()
    # its outputs feed JAX's own call of the program (the next step's pages)
    before = np.asarray(out[2])
    again = compiled(args[0], args[1], out[2:], out[1])
    np.testing.assert_array_equal(np.asarray(again[1][0])[2], before[2] + 15.0)


def test_the_wrong_number_of_arguments_is_a_clear_error(compiled):
    with pytest.raises(ValueError, match="expected 6 arguments, got 5"):
        DirectCall(compiled)(jax.tree.leaves(_args())[:5])


def test_a_program_with_a_host_callback_keeps_the_dispatcher():
    def noisy(x):
        jax.debug.callback(lambda v: None, x)
        return x + 1

    compiled = jax.jit(noisy).lower(jnp.zeros(3)).compile()
    call = DirectCall(compiled)
    assert not call.direct
    np.testing.assert_array_equal(np.asarray(call([jnp.ones(3)])[0]), np.full(3, 2.0))


def test_debug_nans_goes_through_the_dispatcher_and_its_check(compiled):
    call = DirectCall(compiled)
    x, unused, pages, step = _args()
    with jax.debug_nans(True):
        with pytest.raises(FloatingPointError):
            call([x * jnp.nan, unused, *pages, step])
