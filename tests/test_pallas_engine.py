"""The engine with attention_backend="pallas" (Mosaic GPU kernel, interpret mode on CPU) against
transformers. Interpret mode costs about a second per layer and step, so the engine runs one
token bucket (16) and few steps: three prompts (13, 1 and 20 tokens) prefilled in 16-token
chunks, then 5 greedy tokens each (the first prompt's last one attends across its page
boundary)."""

from __future__ import annotations

import numpy as np
import pytest
from model_harness import PagedSequence, hf_greedy, hf_logits, load

from nori_jax import LLM, SamplingParams

PROMPTS = [[5, 17, 33, 101, 7, 250, 12, 99, 64, 3, 180, 44, 21], [9], list(range(40, 60))]


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_pallas_logits_match_transformers(hf_checkpoints, name):
    path = hf_checkpoints[name]
    tokens = PROMPTS[0] + PROMPTS[2]
    ours = PagedSequence(load(path, backend="pallas")).feed(tokens)
    np.testing.assert_allclose(ours, hf_logits(path, tokens), rtol=1e-4, atol=1e-4)


ENGINE = dict(
    dtype="float32",
    page_size=16,
    num_pages=48,
    max_num_seqs=4,
    max_num_batched_tokens=16,
    max_model_len=128,
    attention_backend="pallas",
)


# attention_tuning: the bucket's default schedule with its prefill tiles picked per call
# (tests/kernels/test_tuning_overrides.py checks the override becomes that schedule)
@pytest.mark.parametrize(
    "tuning", [None, "prefill_interleave=per_step"], ids=["default", "per_step"]
)
def test_pallas_engine_greedy_tokens_match_transformers(hf_checkpoints, tuning):
    path = hf_checkpoints["llama"]
    llm = LLM(str(path), **ENGINE, attention_tuning=tuning)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == hf_greedy(path, PROMPTS, 5)
    assert llm.engine.num_recompiles == 0


def test_a_schedule_a_bucket_cannot_take_fails_at_start_naming_it(hf_checkpoints):
    """The override reaches the kernel calls: three compute warpgroups beside the bucket's
    two-warpgroup form (its interleaved prefill tiles) fail while the engine compiles, naming the
    override and the bucket."""
    path = str(hf_checkpoints["llama"])
    with pytest.raises(ValueError, match=r"attention_tuning 'compute_wgs=3' does not fit the "
                       r"bucket of 16 tokens x 4 sequences .* needs compute_wgs=2"):  # fmt: skip
        LLM(path, **ENGINE, attention_tuning="compute_wgs=3")


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(attention_backend="reference"), "attention_backend='reference' has none"),
        # auto is the reference on a CPU: known only when the engine is built
        (dict(attention_backend="auto"), "attention_backend resolves to 'reference'"),
        (dict(attention_tuning="stages=3"), "'stages' is not a TuningConfig field"),
    ],
)
def test_attention_tuning_errors_before_the_model_loads(hf_checkpoints, changes, message):
    kw = {**ENGINE, "attention_tuning": "num_stages=3", **changes}
    with pytest.raises(ValueError, match=message):
        LLM(str(hf_checkpoints["llama"]), **kw)


def test_attention_tuning_on_a_float32_gpu_model_is_refused():
    """A float32 model on a GPU attends on the reference path (api.py), where a schedule would
    silently do nothing; the same dtype on a CPU runs the kernel interpreted and keeps it."""
    from nori_jax.engine import resolve_attention_tuning

    with pytest.raises(ValueError, match="float32 model on a GPU attends on the reference path"):
        resolve_attention_tuning("num_stages=3", "pallas", dtype=np.float32, platform="gpu")
    kept = resolve_attention_tuning("num_stages=3", "pallas", dtype=np.float32, platform="cpu")
    on_gpu = resolve_attention_tuning("num_stages=3", "pallas", dtype="bfloat16", platform="gpu")
    assert kept == on_gpu
    assert kept and kept[0].fields == (("num_stages", 3),)
