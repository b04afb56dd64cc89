"""`nori-jax generate`: complete one or more prompts offline and print the texts."""

from __future__ import annotations

import argparse
import sys

from nori_jax.engine_args import add_engine_args, engine_config_from_args
from nori_jax.follower import exit_when_a_follower_is_lost


def add_generate_args(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Complete each prompt with the engine in this process and print the texts, one per "
        "prompt. Without --config, the engine preset is sized for the backend (see the engine "
        "flags)."
    )
    g = p.add_argument_group("generation")
    g.add_argument(
        "--prompt", action="append", help="a prompt (repeatable; default: read one from stdin)"
    )
    g.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt")
    g.add_argument(
        "--n",
        type=int,
        default=1,
        help="samples of each prompt (seeded with --sampling-seed + j); with n > 1 each text "
        "follows a line `[prompt i, sample j]`",
    )
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest (0: all)")
    g.add_argument(
        "--min-p",
        type=float,
        default=0.0,
        help="keep tokens at least min_p times as likely as the likeliest (0: off)",
    )
    g.add_argument(
        "--presence-penalty",
        type=float,
        default=0.0,
        help="subtracted once from every generated token's logit, in [-2, 2] (0: off)",
    )
    g.add_argument(
        "--frequency-penalty",
        type=float,
        default=0.0,
        help="subtracted per time a token was generated, in [-2, 2] (0: off)",
    )
    g.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="divides the positive logits (multiplies the negative ones) of the prompt's and "
        "output's tokens, in [0.01, 100] (1: off)",
    )
    g.add_argument(
        "--min-tokens",
        type=int,
        default=0,
        help="no EOS or stop before this many tokens",
    )
    g.add_argument(
        "--sampling-seed", type=int, default=None, help="seed of the sampling (default: random)"
    )
    g.add_argument(
        "--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens"
    )
    g.add_argument(
        "--logprobs",
        type=int,
        default=None,
        metavar="K",
        help="after each text, a line per token: its logprob and, with K >= 1, the K likeliest "
        "tokens with theirs (at most 20)",
    )
    g.add_argument(
        "--prompt-logprobs",
        type=int,
        default=None,
        metavar="K",
        help="before each text, a line per prompt token: its logprob given the tokens before it "
        "(the text's score) and, with K >= 1, its position's K likeliest (at most 20)",
    )
    add_engine_args(p)
    p.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    from nori_jax import LLM, SamplingParams

    # Built before the engine starts, so a bad flag fails at once (ValueError).
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
        min_tokens=args.min_tokens,
        seed=args.sampling_seed,
        ignore_eos=args.ignore_eos,
        logprobs=args.logprobs,
        prompt_logprobs=args.prompt_logprobs,
        n=args.n,
    )
    config = engine_config_from_args(args)
    if not config.distributed.is_leader:  # a multi-host follower: process 0 has the prompts
        from nori_jax.follower import follow

        return follow(config)
    if not args.prompt and sys.stdin is None:  # started with stdin closed (`<&-`)
        raise ValueError("no --prompt, and no stdin to read one from")
    prompts = args.prompt or [sys.stdin.read()]
    llm = LLM.from_config(config)
    with exit_when_a_follower_is_lost():
        for i, out in enumerate(llm.generate(prompts, params)):
            if params.n > 1:
                print(f"[prompt {i // params.n}, sample {out.index}]")
            if out.prompt_logprobs is not None:
                print(prompt_logprob_lines(llm.tokenizer, out))
            print(out.text)
            if out.logprobs is not None:
                print(logprob_lines(llm.tokenizer, out))
    return 0


def _shown(tokenizer, token_id: int) -> str:
    if tokenizer is None:
        return f"<{token_id}>"
    return repr(tokenizer.decode([token_id], skip_special_tokens=False))


def _lines(tokenizer, token_ids, logprobs, tops) -> list[str]:
    """One line per token: the token (quoted), its logprob, then the likeliest tokens with
    theirs where asked for."""
    lines = []
    for token_id, logprob, top in zip(token_ids, logprobs, tops, strict=True):
        line = f"  {_shown(tokenizer, token_id)}\t" + ("-" if logprob is None else f"{logprob:.4f}")
        if top:
            line += "\t| " + ", ".join(f"{_shown(tokenizer, t)} {v:.4f}" for t, v in top)
        lines.append(line)
    return lines


def logprob_lines(tokenizer, out) -> str:
    """A line per output token with its logprob (and the likeliest tokens where asked for)."""
    tops = out.top_logprobs or [[] for _ in out.token_ids]
    return "\n".join(_lines(tokenizer, out.token_ids, out.logprobs, tops))


def prompt_logprob_lines(tokenizer, out) -> str:
    """A line per prompt token with its logprob given those before it (the first has none), and
    their sum: the prompt's log-likelihood under the model."""
    ids, values = out.prompt_token_ids, out.prompt_logprobs
    tops = [t or [] for t in out.prompt_top_logprobs or [None] * len(ids)]
    total = sum(v for v in values if v is not None)
    return "\n".join([*_lines(tokenizer, ids, values, tops), f"  prompt logprob sum {total:.4f}"])
