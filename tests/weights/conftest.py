"""Session fixtures: the embedded SmolLM2 GGUF loaded by us and by transformers, once each."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import hf_gguf_reference
import pytest

from nori_jax.weights.default_model import default_model_path
from nori_jax.weights.gguf import GGUFCheckpoint


@pytest.fixture(scope="session")
def embedded_path() -> Path:
    return default_model_path().resolve()


@pytest.fixture(scope="session")
def ours(embedded_path: Path) -> GGUFCheckpoint:
    return hf_gguf_reference.checkpoint(embedded_path)


@pytest.fixture(scope="session")
def hf_tok(embedded_path: Path) -> Any:
    return hf_gguf_reference.hf_tokenizer(embedded_path)


@pytest.fixture(scope="session")
def hf_model(embedded_path: Path) -> Any:
    return hf_gguf_reference.hf_model(embedded_path)
