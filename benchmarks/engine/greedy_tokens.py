"""Greedy tokens of a fixed set of prompts, as JSON: run it from two trees and compare.

    python benchmarks/engine/greedy_tokens.py --config h200-throughput --num-prompts 64 \
        --max-tokens 32 --out tokens.json

Prompts are random token ids from a fixed seed (lengths 1 to 1,500, or `--max-prompt-len`), so
any model shape works.
Uses only the public `LLM` API, so it runs on any tree of the project.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from nori_jax import LLM, SamplingParams
from nori_jax.engine_args import add_engine_args, engine_config_from_args


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_args(p)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument(
        "--max-prompt-len", type=int, default=1500, help="prompt lengths from 1 up to below this"
    )
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if args.max_prompt_len < 2:
        p.error(
            f"--max-prompt-len {args.max_prompt_len} must be at least 2 (2 gives one-token prompts)"
        )
    llm = LLM.from_config(engine_config_from_args(args))
    vocab = llm.engine.model.config.vocab_size
    rng = np.random.default_rng(1234)
    lens = rng.integers(1, args.max_prompt_len, args.num_prompts)
    prompts = [rng.integers(10, vocab - 10, int(n)).tolist() for n in lens]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params)
    with open(args.out, "w") as f:
        json.dump([o.token_ids for o in outs], f)
    print(f"wrote {len(outs)} outputs to {args.out}")


if __name__ == "__main__":
    main()
