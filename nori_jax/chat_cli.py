"""`nori-jax chat`: an interactive terminal chat with streamed replies (the chat template).

Sampling starts from the model's own generation config (generation_config.json, a GGUF file's
general.sampling.* keys) and otherwise from a low temperature, which keeps a small model such as
the embedded SmolLM2-135M on topic; flags override both. Ctrl-C stops a reply midway and the
conversation goes on; Ctrl-D or /exit quits.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, TextIO

from nori_jax.engine_args import add_engine_args, engine_config_from_args
from nori_jax.prompts import lone_surrogate

# Without a generation config: near-greedy, with a tight nucleus. On the embedded 135M model,
# four seeds of "What is the capital of France?" answered "The capital of France is Paris." 4/4
# times at temperature 0.2, top_p 0.5, but 0/4 at 0.2 / 0.8 and 0/3 at 0.7 / 0.95 (French
# word salad); greedy decoding is right too, but loops more on longer replies.
FALLBACK_SAMPLING = {"temperature": 0.2, "top_p": 0.5}
COMMANDS = {
    "/reset": "start a new conversation (the --system prompt stays)",
    "/help": "list these commands",
    "/exit": "quit (Ctrl-D too)",
}
HELP = (
    "\n".join(f"  {name:<7} {what}" for name, what in COMMANDS.items())
    + "\n  Ctrl-C  stop a reply midway; the conversation goes on"
)
BANNER = "Type a message and press Enter; /help lists the commands."


@contextlib.contextmanager
def interrupt_flag() -> Iterator[threading.Event]:
    """SIGINT sets the yielded event instead of raising KeyboardInterrupt, for the duration.

    A KeyboardInterrupt raised inside an engine step could land between donating the KV pages
    to the device and storing the new ones; a flag checked between steps never can.
    """
    flag = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield flag  # signals reach only the main thread: nothing to defer here
        return
    previous = signal.signal(signal.SIGINT, lambda *_: flag.set())
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)


def sampling_defaults(model_generation_config: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """(temperature/top_p/top_k defaults, where they came from)."""
    if model_generation_config:
        return dict(model_generation_config), "the model's generation config"
    return dict(FALLBACK_SAMPLING), "a low temperature (the model has no generation config)"


class ChatSession:
    """The conversation and its commands, over an `LLMEngine` (or anything with its methods)."""

    def __init__(self, engine, params, system: str | None = None, out: TextIO = sys.stdout):
        self.engine, self.params, self.out = engine, params, out
        self.base = [{"role": "system", "content": system}] if system else []
        self.messages = list(self.base)

    def say(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def handle(self, line: str) -> bool:
        """Act on one input line; False once the session should end."""
        text = line.strip()
        if not text:
            return True
        if text.startswith("/"):
            return self._command(text)
        if (why := lone_surrogate(line)) is not None:  # undecodable input: the tokenizer's
            self.say(f"error: the message {why}")  # TypeError ended the session before
            return True
        self.messages.append({"role": "user", "content": line})
        try:
            reply = self.reply()
        except ValueError as e:  # the conversation no longer fits max_model_len, say
            self.messages.pop()
            self.say(f"error: {e} (/reset starts over)")
            return True
        self.messages.append({"role": "assistant", "content": reply})
        return True

    def _command(self, text: str) -> bool:
        if text == "/exit":
            return False
        if text == "/reset":
            turns = sum(m["role"] == "user" for m in self.messages)
            self.messages = list(self.base)
            kept = " (the system prompt is kept)" if self.base else ""
            self.say(f"conversation cleared: {turns} turn(s) forgotten{kept}")
        elif text == "/help":
            self.say(HELP)
        else:
            self.say(f"unknown command {text.split()[0]}; /help lists the commands")
        return True

    def reply(self) -> str:
        """Stream the assistant's next turn; Ctrl-C stops it early. Returns the text shown."""
        engine = self.engine
        prompt = engine.tokenizer.encode_chat(self.messages)
        with interrupt_flag() as interrupted:
            request_id = engine.add_request(None, prompt, self.params)
            text = ""
            while True:
                if interrupted.is_set():
                    engine.abort(request_id)
                    engine.drain()
                    self.out.write("\n[reply interrupted]\n")
                    self.out.flush()
                    return text
                for o in engine.step():
                    if o.request_id != request_id:
                        continue
                    self.out.write(o.new_text)
                    self.out.flush()
                    text = o.text
                    if o.finished:
                        self.out.write("\n")
                        engine.drain()
                        return text

    def run(self, read: Callable[[str], str] = input) -> int:
        self.say(BANNER)
        while True:
            try:
                line = read("> ")
            except (EOFError, RuntimeError):  # RuntimeError: input() without a stdin (closed)
                self.say("")
                return 0
            except KeyboardInterrupt:
                self.say("\n(Ctrl-D or /exit quits)")
                continue
            if not self.handle(line):
                return 0


def add_chat_args(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Chat with the model in the terminal, through its chat template, replies streamed. "
        + BANNER
    )
    g = p.add_argument_group("chat")
    g.add_argument("--system", default=None, help="a system prompt (default: none)")
    g.add_argument("--max-tokens", type=int, default=512, help="longest reply, in tokens")
    model_first = "default: the model's generation config, else"
    g.add_argument(
        "--temperature",
        type=float,
        default=None,
        help=f"0 is greedy ({model_first} {FALLBACK_SAMPLING['temperature']})",
    )
    g.add_argument(
        "--top-p",
        type=float,
        default=None,
        help=f"nucleus sampling mass ({model_first} {FALLBACK_SAMPLING['top_p']})",
    )
    g.add_argument(
        "--top-k", type=int, default=None, help=f"sample among the k likeliest ({model_first} all)"
    )
    g.add_argument(
        "--min-p",
        type=float,
        default=None,
        help=f"keep tokens at least min_p times as likely as the likeliest ({model_first} 0)",
    )
    g.add_argument(
        "--repetition-penalty",
        type=float,
        default=None,
        help=f"penalize the conversation's tokens, in [0.01, 100] ({model_first} 1: off)",
    )
    g.add_argument("--sampling-seed", type=int, default=None, help="seed (default: random)")
    add_engine_args(p)
    p.set_defaults(func=run_chat)


def run_chat(args: argparse.Namespace) -> int:
    import logging

    from nori_jax.engine import make_engine
    from nori_jax.sampling_params import SamplingParams

    if args.system is not None and (why := lone_surrogate(args.system)) is not None:
        raise ValueError(f"--system {why}")
    engine = make_engine(engine_config_from_args(args))
    if engine.tokenizer is None or engine.tokenizer.chat_template is None:
        raise ValueError("this model has no chat template; use `nori-jax generate` instead")
    sampling, source = sampling_defaults(engine.model.generation_config)
    flags = {
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "min_p": args.min_p,
        "repetition_penalty": args.repetition_penalty,
    }
    sampling.update({k: v for k, v in flags.items() if v is not None})
    params = SamplingParams(max_tokens=args.max_tokens, seed=args.sampling_seed, **sampling)
    logging.getLogger(__name__).info("sampling: %s, from %s and the flags", sampling, source)
    return ChatSession(engine, params, args.system).run()
