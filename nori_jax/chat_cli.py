"""`nori-jax chat`: an interactive terminal chat with streamed replies (the chat template)."""

from __future__ import annotations

import argparse
import sys

from nori_jax.engine import LLMEngine
from nori_jax.engine_args import add_engine_args, engine_config_from_args
from nori_jax.sampling_params import SamplingParams

HELP = "Type a message; /reset starts over, /exit (or Ctrl-D) quits."


def stream_reply(
    engine: LLMEngine, messages: list[dict], params: SamplingParams, out=sys.stdout
) -> str:
    """Generate the assistant's next turn, writing text as it arrives; returns the whole reply."""
    request_id = engine.add_request(None, engine.tokenizer.encode_chat(messages), params)
    reply = ""
    while True:
        for o in engine.step():
            if o.request_id == request_id:
                out.write(o.new_text)
                out.flush()
                reply = o.text
                if o.finished:
                    out.write("\n")
                    engine.drain()
                    return reply


def _chat(args: argparse.Namespace) -> int:
    engine = LLMEngine(engine_config_from_args(args))
    if engine.tokenizer is None or engine.tokenizer.chat_template is None:
        raise ValueError("this model has no chat template; use `nori-jax generate` instead")
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p
    )
    base = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(base)
    print(HELP)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return 0
        if line.strip() == "/exit":
            return 0
        if line.strip() == "/reset":
            messages = list(base)
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        messages.append({"role": "assistant", "content": stream_reply(engine, messages, params)})


def add_chat_parser(sub) -> None:
    p = sub.add_parser("chat", help="interactive chat in the terminal, streaming")
    add_engine_args(p)
    p.add_argument("--system", default=None, help="a system prompt")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.95)
    p.set_defaults(func=_chat)
