"""Host cost of streaming detokenization: microseconds per output token on the embedded SmolLM2
tokenizer (the engine runs this once per sequence per step).

    python benchmarks/engine/detokenize_bench.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

from nori_jax.tokenizer import IncrementalDetokenizer
from nori_jax.weights.default_model import default_model_path
from nori_jax.weights.gguf_file import read_gguf_file
from nori_jax.weights.gguf_tokenizer import tokenizer_from_gguf

TEXT = (
    "The capital of France is Paris. Ünïcödé, 日本語 and emojis 🎉 split across byte tokens.\n"
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"
) * 40


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    path = default_model_path()
    tok = tokenizer_from_gguf(read_gguf_file(path).metadata, path)
    prompt = tok.encode("Write something:", add_special_tokens=False)
    ids = tok.encode(TEXT, add_special_tokens=False)
    times = []
    for _ in range(args.repeats):
        detok = IncrementalDetokenizer(tok, prompt)
        start = time.perf_counter()
        for i in ids:
            detok.add(i)
        times.append((time.perf_counter() - start) / len(ids))
        assert detok.text == tok.decode(ids)
    per_token_us = statistics.median(times) * 1e6
    print(f"{len(ids)} tokens: {per_token_us:.2f} us per token (median of {args.repeats})")


if __name__ == "__main__":
    main()
