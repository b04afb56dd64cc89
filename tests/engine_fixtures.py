"""Small engines for behaviour tests (float32, tiny shapes, few buckets)."""

from __future__ import annotations

from nori_jax import LLM

SMALL = dict(
    dtype="float32",
    page_size=16,
    num_pages=64,
    max_num_seqs=8,
    max_num_batched_tokens=64,
    max_model_len=256,
)


def small_llm(model: str, **overrides) -> LLM:
    kwargs = dict(SMALL)
    kwargs.update(overrides)
    if model == "tiny-llama":
        kwargs.setdefault("load_format", "dummy")
    return LLM(model, **kwargs)
