"""The top-k forms of the logprob programs (executor/top_k.py) give exactly `lax.top_k`'s result:
values, indices and their order, ties (lower index first) and -inf entries included."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nori_jax.executor.top_k import FORMS, top_k


def rows(seed: int, shape, kind: str) -> jax.Array:
    rng = np.random.default_rng(seed)
    if kind == "ties":  # few distinct values: ties everywhere, across chunks too
        x = rng.integers(-3, 3, shape).astype(np.float32)
    else:
        x = rng.standard_normal(shape).astype(np.float32) * 4
    if kind == "neg_inf":  # most of a row banned: the top k reach into the -inf entries
        x[..., 7:] = -np.inf
    return jnp.asarray(x)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize(
    "shape, k, kind",
    [
        ((6, 1000), 20, "normal"),  # rows not a whole number of chunks
        ((3, 2048), 17, "ties"),
        ((4, 1536), 20, "neg_inf"),
        ((5, 777), 5, "normal"),  # k <= 16: lax.top_k itself
        ((2, 3, 640), 33, "ties"),  # three passes; a leading batch axis
        ((2, 20), 20, "normal"),  # k = the row's length
    ],
)
def test_equals_lax_top_k(form, shape, k, kind):
    x = rows(k, shape, kind)
    want_v, want_i = jax.lax.top_k(x, k)
    got_v, got_i = jax.jit(top_k, static_argnums=(1, 2))(x, k, form)
    np.testing.assert_array_equal(np.asarray(got_i), np.asarray(want_i))
    np.testing.assert_array_equal(np.asarray(got_v), np.asarray(want_v))
    assert got_i.dtype == jnp.int32


def test_bad_k_and_form_are_refused():
    x = jnp.zeros((2, 8))
    with pytest.raises(ValueError, match="k=9 must be from 1 to the row's length 8"):
        top_k(x, 9, "passes")
    with pytest.raises(ValueError, match="form 'sort'"):
        top_k(x, 4, "sort")


def test_the_environment_picks_the_engine_form(monkeypatch):
    from nori_jax.executor import top_k as module

    monkeypatch.setenv("NORI_JAX_TOP_K", "chunks")
    assert module.default_form() == "chunks"
    monkeypatch.setenv("NORI_JAX_TOP_K", "bogus")
    with pytest.raises(ValueError, match="NORI_JAX_TOP_K='bogus'"):
        module.default_form()


def test_auto_takes_chunks_for_small_inputs_and_passes_above(monkeypatch):
    from nori_jax.executor import top_k as module

    seen = []
    for name in ("_chunks", "_passes"):
        real = getattr(module, name)
        monkeypatch.setattr(
            module, name, lambda x, k, real=real, name=name: seen.append(name) or real(x, k)
        )
    monkeypatch.setattr(module, "CHUNKS_MAX_ELEMENTS", 4 * 1000)
    x = rows(0, (4, 1000), "normal")
    module.top_k(x, 20, "auto")
    module.top_k(jnp.concatenate([x, x]), 20, "auto")
    assert seen == ["_chunks", "_passes"]
