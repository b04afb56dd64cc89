"""fp8 weights in decode: the fp8 GEMM against the weight-only form, each against bfloat16.

    python benchmarks/quality/fp8_decode_agreement.py [--prompts 16] [--max-tokens 32]

The embedded SmolLM2-135M-Instruct, bfloat16 compute. Each chat prompt is prefilled, then fed
bfloat16's own greedy output one token at a time (calls of one token: the engine's decode, where
`quantized_matmul="auto"` makes fp8 layers weight-only), so every position has the same context
in every run. Prints, for fp8 layers on the fp8 GEMM (per-token activation scales,
`quantized_matmul="xla"`) and weight-only (`"upcast"`): the share of positions whose greedy
choice equals bfloat16's, and the logit error: the mean absolute difference from bfloat16's
logits over their mean absolute value. quantization_accuracy.py's engine rows compare
free-running outputs instead, which part ways after a first difference and say less per
position. About 5 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from model_harness import PagedSequence  # noqa: E402
from quantization_accuracy import TOPICS  # noqa: E402

from nori_jax.executor.mesh import make_mesh  # noqa: E402
from nori_jax.mesh_config import MeshConfig  # noqa: E402
from nori_jax.weights.loader import load_model  # noqa: E402


def _load(quantization=None, small_matmul="xla"):
    return load_model(
        None,
        dtype="bfloat16",
        quantization=quantization,
        small_matmul=small_matmul,
        mesh=make_mesh(MeshConfig()),
        param_cache=False,
    )


def decode(model, prompts, max_tokens, context=None):
    """Per prompt: the greedy choice and the logits at each output position, fed `context`
    (default: the model's own choices) one token at a time."""
    choices, logits = [], []
    for i, prompt in enumerate(prompts):
        seq = PagedSequence(model, max_len=256)
        last = seq.feed(prompt)[-1]
        mine, rows = [], []
        for j in range(max_tokens):
            mine.append(int(last.argmax()))
            rows.append(np.asarray(last, np.float32))
            last = seq.feed([mine[-1] if context is None else context[i][j]])[-1]
        choices.append(mine)
        logits.append(np.stack(rows))
    return choices, logits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    bf16 = _load()
    prompts = [
        bf16.tokenizer.encode_chat([{"role": "user", "content": t}]) for t in TOPICS[: args.prompts]
    ]
    ref, ref_logits = decode(bf16, prompts, args.max_tokens)
    for name, small in (("fp8 GEMM (xla)", "xla"), ("fp8 weight-only (upcast)", "upcast")):
        got, logits = decode(_load("fp8", small), prompts, args.max_tokens, ref)
        same = np.mean(np.concatenate([np.equal(a, b) for a, b in zip(got, ref, strict=True)]))
        err = np.mean(
            [
                np.abs(a - b).mean() / np.abs(b).mean()
                for a, b in zip(logits, ref_logits, strict=True)
            ]
        )
        print(f"{name}: greedy = bfloat16 at {same:.1%} of positions, logit error {err:.4f}")


if __name__ == "__main__":
    main()
