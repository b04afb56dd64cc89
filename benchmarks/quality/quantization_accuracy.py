"""Accuracy of the weight quantization modes on the embedded SmolLM2-135M-Instruct (CPU is fine).

    python benchmarks/quality/quantization_accuracy.py [--prompts 16] [--max-tokens 32]

For float32, bfloat16 and each `quantization` mode (bfloat16 compute): the perplexity of
perplexity.py's public-domain text, and the greedy tokens of a fixed set of chat prompts through
the engine, compared with bfloat16's: the share of generated tokens identical position by
position (after a first difference the two texts part ways, so this undercounts), the share of
prompts whose whole output is identical, the mean position of the first difference, and the
teacher-forced share: each mode's greedy choice on bfloat16's own prompt + output (the same
context everywhere), which measures every position. The embedded file is Q4_1 (its float32
figure is Q4_1 dequantized), so:

    int4             keeps the file's Q4_1 blocks (exact; weights/gguf_quantized.py)
    int4 requant g32 what int4 does to a float checkpoint, symmetric groups (576 inputs allow 32
                     or 64, not 128): here a second 4-bit rounding of 4-bit values
    int8, fp8        re-quantized from the float32 dequantization of the Q4_1 values

KV rows store the pages in fp8 (`kv_cache_dtype`), with the default scales of 1.0 or calibrated
ones (`calculate_kv_scales`, executor/kv_calibration.py). `--modes` picks rows by label.

Prints a markdown table (the one in docs/benchmarks.md, "Quantization accuracy").
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from perplexity import TEXT, our_logits, perplexity  # noqa: E402

from nori_jax import LLM, SamplingParams  # noqa: E402
from nori_jax.executor.kv_calibration import (  # noqa: E402
    calibration_token_ids,
    measure_kv_scales,
)
from nori_jax.executor.mesh import make_mesh  # noqa: E402
from nori_jax.mesh_config import MeshConfig  # noqa: E402
from nori_jax.quantization.scheme import WeightQuantization  # noqa: E402
from nori_jax.weights.loader import load_model  # noqa: E402
from pallas_kernels.kv_layout import kv_page_dtype  # noqa: E402

TOPICS = [
    "Explain how a rainbow forms.",
    "Write a haiku about the sea.",
    "What is the capital of France, and why is it famous?",
    "Give three tips for learning to play the guitar.",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "How do vaccines work?",
    "Write a short poem about a cat who loves the rain.",
    "What are the main differences between a virus and a bacterium?",
    "Describe a healthy breakfast.",
    "Why is the sky blue?",
    "List four planets of the solar system and one fact about each.",
    "How does a bicycle stay upright?",
    "Write a friendly email inviting a colleague to lunch.",
    "What is photosynthesis?",
    "Tell me a short story about a brave mouse.",
    "How can I improve my sleep?",
    "Explain what a prime number is to a child.",
    "What should I pack for a weekend hike?",
    "Describe the water cycle.",
    "Give me a recipe for a simple tomato soup.",
]
# (label, dtype, quantization argument, kv_cache_dtype, calculate_kv_scales)
MODES = [
    ("float32", "float32", None, "auto", False),
    ("bfloat16", "bfloat16", None, "auto", False),
    ("fp8", "bfloat16", "fp8", "auto", False),
    ("fp8 (fp8 GEMM in every call)", "bfloat16", "fp8", "auto", False),
    ("int8", "bfloat16", "int8", "auto", False),
    ("int4 (Q4_1 blocks kept)", "bfloat16", "int4", "auto", False),
    (
        "int4 requant g32",
        "bfloat16",
        WeightQuantization("int4", 32, source="re-quantized"),
        "auto",
        False,
    ),
    ("fp8 KV (e4m3, scales 1.0)", "bfloat16", None, "fp8", False),
    ("fp8 KV (e4m3, calibrated)", "bfloat16", None, "fp8", True),
    ("fp8 KV (e5m2, scales 1.0)", "bfloat16", None, "fp8_e5m2", False),
    ("fp8 weights + fp8 KV (calibrated)", "bfloat16", "fp8", "fp8", True),
    ("int4 (Q4_1 kept) + fp8 KV (calibrated)", "bfloat16", "int4", "fp8", True),
]
# The engine's quantized_matmul for a row (default "auto": fp8's calls of up to 64 tokens
# weight-only, models/linear.py). Perplexity and teacher forcing run calls of hundreds of tokens,
# which take the fp8 GEMM either way; the engine's greedy decode is where the two differ.
MATMUL = {"fp8 (fp8 GEMM in every call)": "xla"}


def engine_tokens(
    dtype,
    quantization,
    prompts,
    max_tokens,
    kv_cache_dtype="auto",
    calibrate=False,
    quantized_matmul="auto",
) -> list[list[int]]:
    if isinstance(quantization, WeightQuantization):  # not an EngineConfig value: load directly
        return _tokens_from_loaded(dtype, quantization, prompts, max_tokens)
    llm = LLM(
        None,
        dtype=dtype,
        quantization=quantization,
        quantized_matmul=quantized_matmul,
        kv_cache_dtype=kv_cache_dtype,
        calculate_kv_scales=calibrate,
        max_num_seqs=len(prompts),
        max_num_batched_tokens=512,
        max_model_len=1024,
        num_pages=512,
        page_size=16,
        param_cache=False,
    )
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.chat([[{"role": "user", "content": t}] for t in prompts], params)
    assert llm.engine.num_recompiles == 0
    return [o.token_ids for o in outs]


def _tokens_from_loaded(dtype, scheme, prompts, max_tokens):
    """Greedy decoding straight on the model (a layout the engine's config does not name)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    from model_harness import PagedSequence

    loaded = load_model(
        None, dtype=dtype, quantization=scheme, mesh=make_mesh(MeshConfig()), param_cache=False
    )
    outs = []
    for t in prompts:
        ids = loaded.tokenizer.encode_chat([{"role": "user", "content": t}])
        seq = PagedSequence(loaded, max_len=1024)
        logits, out = seq.feed(ids), []
        for _ in range(max_tokens):
            out.append(int(logits[-1].argmax()))
            logits = seq.feed([out[-1]])
        outs.append(out)
    return outs


def teacher_forced(loaded, prompts, ref_tokens, length: int = 512, **kv) -> list[np.ndarray]:
    """Greedy choices at every output position given bfloat16's context: one forward per prompt,
    padded to `length` (causal: the padding changes no earlier position), one compile per mode."""
    out = []
    for t, ref in zip(prompts, ref_tokens, strict=True):
        ids = loaded.tokenizer.encode_chat([{"role": "user", "content": t}]) + ref
        assert len(ids) <= length
        logits = our_logits(loaded, ids + [0] * (length - len(ids)), **kv)
        n = len(ids) - len(ref)
        out.append(logits[n - 1 : len(ids) - 1].argmax(-1))
    return out


def agreement(tokens, ref) -> tuple[float, float, float]:
    same = [np.asarray(a) == np.asarray(b) for a, b in zip(tokens, ref, strict=True)]
    first = [int(np.argmin(s)) if not s.all() else len(s) for s in same]
    return (
        float(np.mean(np.concatenate(same))),
        float(np.mean([s.all() for s in same])),
        float(np.mean(first)),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument(
        "--modes", nargs="*", default=None, help="row labels to run (bfloat16 always runs)"
    )
    args = ap.parse_args()
    prompts = TOPICS[: args.prompts]
    rows, ref = [], None
    # bfloat16 first: its outputs are the reference of every other row
    order = [MODES[1], MODES[0], *MODES[2:]]
    if args.modes is not None:
        order = [m for m in order if m[0] == "bfloat16" or m[0] in args.modes]
    for label, dtype, quantization, kv_cache_dtype, calibrate in order:
        t0 = time.perf_counter()
        loaded = load_model(
            None,
            dtype=dtype,
            quantization=quantization,
            mesh=make_mesh(MeshConfig()),
            param_cache=False,
        )
        kv = {}
        if kv_cache_dtype != "auto":
            mesh = make_mesh(MeshConfig())
            kv_dtype = kv_page_dtype(kv_cache_dtype, loaded.dtype)
            scales = None
            if calibrate:
                scales = measure_kv_scales(loaded, mesh, kv_dtype, calibration_token_ids(loaded))
            kv = dict(kv_dtype=kv_dtype, kv_scales=scales)
        ids = loaded.tokenizer.encode(TEXT)
        ppl = perplexity(our_logits(loaded, ids, **kv), ids)
        weights = loaded.describe_weights() + (f", {kv_cache_dtype} KV" if kv else "")
        mib = loaded.weight_bytes / 2**20
        if ref is None:
            tokens = engine_tokens(dtype, quantization, prompts, args.max_tokens)
            ref = tokens
        forced = teacher_forced(loaded, prompts, ref, **kv)
        del loaded
        if label != "bfloat16":
            tokens = engine_tokens(
                dtype,
                quantization,
                prompts,
                args.max_tokens,
                kv_cache_dtype,
                calibrate,
                MATMUL.get(label, "auto"),
            )
        forced_share = float(np.mean(np.concatenate(forced) == np.concatenate(ref)))
        rows.append((label, weights, mib, ppl, tokens, forced_share))
        print(f"{label}: perplexity {ppl:.3f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    print(
        f"\n{len(prompts)} chat prompts x {args.max_tokens} greedy tokens, compared with bfloat16\n"
    )
    print(
        "| weights | stored | MiB | perplexity | tokens = bf16 | outputs = bf16 | first diff "
        "| teacher-forced = bf16 |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for label, weights, mib, ppl, tokens, forced_share in rows:
        share, whole, first = agreement(tokens, ref)
        print(
            f"| {label} | {weights} | {mib:.0f} | {ppl:.3f} | {share:.1%} | {whole:.0%} | "
            f"{first:.1f} | {forced_share:.1%} |"
        )


if __name__ == "__main__":
    main()
