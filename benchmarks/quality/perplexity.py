# ruff: noqa: E501  (the text below is prose, kept as printed)
"""Perplexity of a model on a short public-domain text: a smoke metric of load + model correctness.

    python benchmarks/quality/perplexity.py [--model PATH_OR_GGUF] [--dtype float32] [--hf]
        [--quantization fp8|int8|int4]

The text is the opening of Lewis Carroll's "Alice's Adventures in Wonderland" (1865, public domain).
Our number comes from the engine's own model over the paged KV cache (one forward over the whole
text); `--hf` computes transformers' number on the same GGUF file for comparison.
"""

from __future__ import annotations

import argparse
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nori_jax.executor.kv_cache import allocate_kv_pages
from nori_jax.executor.mesh import make_mesh
from nori_jax.mesh_config import MeshConfig
from nori_jax.models.llama import AttentionInputs
from nori_jax.weights.loader import load_model

TEXT = (
    "Alice was beginning to get very tired of sitting by her sister on the bank, and of having "
    "nothing to do: once or twice she had peeped into the book her sister was reading, but it had "
    "no pictures or conversations in it, \u201cand what is the use of a book,\u201d thought Alice "
    "\u201cwithout pictures or conversations?\u201d\n\n"
    "So she was considering in her own mind (as well as she could, for the hot day made her feel "
    "very sleepy and stupid), whether the pleasure of making a daisy-chain would be worth the "
    "trouble of getting up and picking the daisies, when suddenly a White Rabbit with pink eyes ran "
    "close by her.\n\n"
    "There was nothing so very remarkable in that; nor did Alice think it so very much out of the "
    "way to hear the Rabbit say to itself, \u201cOh dear! Oh dear! I shall be late!\u201d (when "
    "she thought it over afterwards, it occurred to her that she ought to have wondered at this, "
    "but at the time it all seemed quite natural); but when the Rabbit actually took a watch out of "
    "its waistcoat-pocket, and looked at it, and then hurried on, Alice started to her feet, for it "
    "flashed across her mind that she had never before seen a rabbit with either a "
    "waistcoat-pocket, or a watch to take out of it, and burning with curiosity, she ran across the "
    "field after it, and fortunately was just in time to see it pop down a large rabbit-hole under "
    "the hedge."
)


def our_logits(
    loaded, ids: list[int], page_size: int = 16, kv_dtype=None, kv_scales=None
) -> np.ndarray:
    """Logits of one forward over `ids`; `kv_dtype` (default: the model's) and `kv_scales`
    (float32[layers, 2] for fp8 pages; None: 1.0) choose the KV pages."""
    n = len(ids)
    num_pages = n // page_size + 2
    kv_dtype = loaded.dtype if kv_dtype is None else kv_dtype
    kv = allocate_kv_pages(loaded.config, num_pages, page_size, kv_dtype, make_mesh(MeshConfig()))
    scales = None if kv_scales is None else jnp.asarray(kv_scales, jnp.float32)
    pages = np.arange(1, num_pages, dtype=np.int32)
    pos = np.arange(n, dtype=np.int32)

    @jax.jit
    def forward(state, kv):
        model = nnx.merge(loaded.graphdef, state)
        meta = AttentionInputs(
            jnp.asarray(pages[pos // page_size] * page_size + pos % page_size),
            jnp.asarray([n], jnp.int32),
            jnp.asarray(pages[None, :]),
            jnp.asarray([0, n], jnp.int32),
            jnp.asarray([0, 1], jnp.int32),
        )
        hidden, _ = model(jnp.asarray(ids, jnp.int32), jnp.asarray(pos), kv, meta, scales)
        return model.compute_logits(hidden)

    return np.asarray(forward(loaded.state, kv))


def perplexity(logits: np.ndarray, ids: list[int]) -> float:
    logits = logits[:-1].astype(np.float64)
    targets = np.asarray(ids[1:])
    log_z = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    nll = log_z - logits[np.arange(len(targets)), targets]
    return math.exp(nll.mean())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--model", default=None, help="default: the embedded SmolLM2-135M-Instruct GGUF"
    )
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quantization", default=None, choices=["fp8", "int8", "int4"])
    ap.add_argument("--hf", action="store_true", help="also compute transformers' perplexity")
    args = ap.parse_args()
    loaded = load_model(
        args.model,
        dtype=args.dtype,
        mesh=make_mesh(MeshConfig()),
        quantization=args.quantization,
        param_cache=False,
    )
    ids = loaded.tokenizer.encode(TEXT)
    ppl = perplexity(our_logits(loaded, ids), ids)
    print(f"tokens: {len(ids)}  nori-jax perplexity ({loaded.describe_weights()}): {ppl:.3f}")
    if args.hf:
        import torch
        from transformers import AutoModelForCausalLM

        from nori_jax.weights.default_model import default_model_path

        path = default_model_path() if args.model is None else args.model
        from pathlib import Path

        path = Path(path)
        hf = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        ).eval()
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].numpy()
        print(f"transformers perplexity (float32, same GGUF): {perplexity(ref, ids):.3f}")


if __name__ == "__main__":
    main()
