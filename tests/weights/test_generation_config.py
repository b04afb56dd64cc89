"""A checkpoint's sampling defaults from its generation_config.json: the keys the engine takes
(repetition_penalty included, as vLLM reads it), nothing else, and a broken file ignored."""

from __future__ import annotations

import json

from nori_jax.sampling_params import SamplingParams
from nori_jax.weights.generation_config import from_hf_dir


def test_sampling_keys_are_read_and_the_rest_ignored(tmp_path):
    (tmp_path / "generation_config.json").write_text(
        json.dumps(
            {
                "temperature": 0.6,
                "top_p": 0.9,
                "top_k": 20,
                "repetition_penalty": 1.05,
                "do_sample": True,
                "eos_token_id": [1, 2],
                "min_p": None,
            }
        )
    )
    defaults = from_hf_dir(tmp_path)
    assert defaults == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.05}
    SamplingParams(**defaults)  # what `nori-jax chat` starts from


def test_no_file_or_a_broken_one_gives_no_defaults(tmp_path):
    assert from_hf_dir(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text("{not json")
    assert from_hf_dir(tmp_path) == {}
