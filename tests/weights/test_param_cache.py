"""The converted-parameter cache keys on file contents: copies of one GGUF at two paths (two
installs) share one entry; other weights get another. Also what a short model does to a preset's
max_model_len, and a GGUF file's own sampling defaults."""

from __future__ import annotations

import shutil
from pathlib import Path

import jax.numpy as jnp
import pytest
from tiny_gguf import write_tiny_gguf

from nori_jax import LLM
from nori_jax.weights import checkpoint_cache

SMALL = dict(max_num_seqs=4, max_num_batched_tokens=32, num_pages=32, page_size=16)


@pytest.fixture
def param_cache(tmp_path: Path, monkeypatch) -> Path:
    root = tmp_path / "params"
    monkeypatch.setenv("NORI_JAX_PARAM_CACHE", str(root))
    return root


@pytest.fixture
def two_copies(tmp_path: Path) -> tuple[Path, Path]:
    a = tmp_path / "install-a" / "model.gguf"
    b = tmp_path / "install-b" / "other-name.gguf"
    a.parent.mkdir()
    b.parent.mkdir()
    sampling = {"general.sampling.temp": 0.5, "general.sampling.top_k": 7}
    write_tiny_gguf(a, extra_metadata=sampling | {"general.sampling.min_p": 0.05})
    shutil.copyfile(a, b)  # a plain copy: another path, another mtime
    return a, b


def test_copies_at_two_paths_have_one_key(param_cache, two_copies, tmp_path):
    a, b = two_copies
    key = lambda p: checkpoint_cache.cache_key(p, jnp.float32, "cfg")  # noqa: E731
    assert key(a) == key(b)
    assert key(a) != checkpoint_cache.cache_key(a, jnp.bfloat16, "cfg")
    other = tmp_path / "other.gguf"
    write_tiny_gguf(other, seed=1, extra_metadata={"general.sampling.temp": 0.5})
    assert key(other) != key(a)
    # The digests are remembered, keyed by path, size and mtime: a rewrite is hashed again.
    assert (param_cache / "digests.json").is_file()
    shutil.copyfile(other, a)
    assert key(a) == key(other)


def test_second_install_restores_the_first_ones_entry(param_cache, two_copies):
    a, b = two_copies
    first = LLM(str(a), **SMALL).engine
    assert not first.model.from_cache
    assert len([p for p in param_cache.iterdir() if p.is_dir()]) == 1
    second = LLM(str(b), **SMALL).engine
    assert second.model.from_cache
    assert len([p for p in param_cache.iterdir() if p.is_dir()]) == 1

    # The tiny model has 256 positions: the cpu preset's max_model_len (2048) clamps to it...
    assert first.max_model_len == 256
    # ...and the file's sampling defaults are there for `nori-jax chat`.
    gen = first.model.generation_config
    assert gen["top_k"] == 7 and gen["temperature"] == pytest.approx(0.5)
    assert gen["min_p"] == pytest.approx(0.05)


def test_an_explicit_max_model_len_above_the_models_limit_is_an_error(param_cache, two_copies):
    with pytest.raises(ValueError, match="max_model_len=2048 exceeds the model's limit of 256"):
        LLM(str(two_copies[0]), max_model_len=2048, **SMALL)
