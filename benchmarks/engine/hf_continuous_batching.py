"""Hugging Face transformers' continuous batching (`generate_batch`, paged sdpa) on a random-weight
model of one of our presets' shapes, over the same lognormal prompts: the peer that runs on the
same GPU, measured in the same call as our engine.

    python benchmarks/engine/hf_continuous_batching.py --model smollm2-135m --num-prompts 100
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig

from nori_jax.bench.workload import LognormalLengths
from nori_jax.model_config import load_preset


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--num-prompts", type=int, default=100)
    ap.add_argument("--output-len", type=int, default=303, help="fixed, the workload's mean output")
    ap.add_argument("--input-max", type=int, default=6144)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--attn",
        default="auto",
        help="attention implementation; auto tries the paged sdpa names of 5.x releases",
    )
    ap.add_argument("--result-json", default=None)
    args = ap.parse_args()

    cfg = {k: v for k, v in load_preset(args.model).items() if k != "model_type"}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(args.seed)
    names = ["paged|sdpa", "sdpa_paged", "sdpa"] if args.attn == "auto" else [args.attn]
    for name in names:  # the paged sdpa kernel's name changed between transformers releases
        try:
            model = AutoModelForCausalLM.from_config(
                LlamaConfig(**cfg), dtype=dtype, attn_implementation=name
            )
            args.attn = name
            break
        except ValueError:
            continue
    model = model.to(device).eval()
    rng = np.random.default_rng(args.seed)
    ins = LognormalLengths(6.2, 0.8, 1, args.input_max).sample(args.num_prompts, rng)
    prompts = [rng.integers(10, cfg["vocab_size"] - 10, int(k)).tolist() for k in ins]
    gen = GenerationConfig(
        max_new_tokens=args.output_len,
        min_new_tokens=args.output_len,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    model.generate_batch(prompts[:4], generation_config=gen)  # warm-up
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    outs = model.generate_batch(prompts, generation_config=gen)
    if device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    n_out = sum(len(o.generated_tokens) for o in outs.values())
    n_in = int(ins.sum())
    result = {
        "model": args.model,
        "num_prompts": args.num_prompts,
        "elapsed_s": elapsed,
        "input_tokens": n_in,
        "output_tokens": n_out,
        "total_token_throughput": (n_in + n_out) / elapsed,
        "output_throughput": n_out / elapsed,
        "request_throughput": args.num_prompts / elapsed,
        "attn": args.attn,
        "device": device,
    }
    print(json.dumps(result))
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(result, f, indent=2)
    os._exit(0)  # the continuous-batching manager's thread may linger


if __name__ == "__main__":
    main()
