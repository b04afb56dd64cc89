"""A checkpoint's own sampling defaults: `generation_config.json` of a Hugging Face directory, the
`general.sampling.*` keys of a GGUF file. Interactive front ends (`nori-jax chat`) start from
these, as vLLM does; the engine itself never applies them."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)
_HF_KEYS = {
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "min_p": float,
    "repetition_penalty": float,
}
_GGUF_KEYS = {
    "general.sampling.temp": ("temperature", float),
    "general.sampling.top_p": ("top_p", float),
    "general.sampling.top_k": ("top_k", int),
    "general.sampling.min_p": ("min_p", float),
}


def from_hf_dir(path: Path) -> dict[str, Any]:
    file = path / "generation_config.json"
    if not file.is_file():
        return {}
    try:
        raw = json.loads(file.read_text())
    except ValueError as e:
        logger.warning("ignoring %s: %s", file, e)
        return {}
    return {k: kind(raw[k]) for k, kind in _HF_KEYS.items() if raw.get(k) is not None}


def from_gguf_metadata(metadata: dict[str, Any]) -> dict[str, Any]:
    return {
        name: kind(metadata[key]) for key, (name, kind) in _GGUF_KEYS.items() if key in metadata
    }
