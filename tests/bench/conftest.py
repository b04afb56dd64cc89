"""Fixtures: the fake server (one process per session) and two small trained tokenizers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import tokenizers
from bench_helpers import FakeServer, save_tokenizer, train_tokenizer
from tokenizers import decoders, models, pre_tokenizers


@pytest.fixture(scope="session")
def fake_server() -> Iterator[FakeServer]:
    server = FakeServer()
    yield server
    server.close()


@pytest.fixture
def server(fake_server: FakeServer) -> FakeServer:
    fake_server.set()  # defaults before every test
    return fake_server


@pytest.fixture(scope="session")
def bytelevel_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """GPT-2 / Llama-3 style: byte-level BPE, BOS added by the post-processor."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    train_tokenizer(tok, 400, pre_tokenizers.ByteLevel.alphabet())
    return save_tokenizer(tok, tmp_path_factory.mktemp("bytelevel"))


@pytest.fixture(scope="session")
def metaspace_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama-2 / Mistral style: '▁word' pieces whose decoder drops the leading space."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    train_tokenizer(tok, 300, [])
    return save_tokenizer(tok, tmp_path_factory.mktemp("metaspace"))
