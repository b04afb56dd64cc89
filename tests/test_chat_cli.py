"""`nori-jax chat`'s loop on a scripted stdin over a fake engine: commands confirm what they did,
Ctrl-C (a real SIGINT) stops a reply and the session goes on, sampling defaults come from the
model's generation config or a low temperature."""

from __future__ import annotations

import dataclasses
import io
import os
import signal

from nori_jax.chat_cli import FALLBACK_SAMPLING, HELP, ChatSession, sampling_defaults


@dataclasses.dataclass
class Out:
    request_id: str
    new_text: str
    text: str
    finished: bool


class FakeTokenizer:
    chat_template = "{{ messages }}"

    def __init__(self):
        self.prompts: list[list[dict]] = []

    def encode_chat(self, messages):
        self.prompts.append([dict(m) for m in messages])
        return [1, 2, 3]


class FakeEngine:
    """Replies "w0 w1 ... w(n-1)", one word a step; `interrupt_at` sends this process a SIGINT
    from inside a step, as Ctrl-C in the terminal would."""

    def __init__(self, words: int = 5, interrupt_at: int | None = None):
        self.tokenizer = FakeTokenizer()
        self.words, self.interrupt_at = words, interrupt_at
        self.aborted: list[str] = []
        self.drains = 0
        self._n = 0
        self._req = None

    def add_request(self, request_id, prompt, params):
        self._req, self._step = f"req-{self._n}", 0
        self._n += 1
        return self._req

    def step(self):
        if self._req is None:
            return []
        i = self._step
        self._step += 1
        if self.interrupt_at is not None and i == self.interrupt_at:
            self.interrupt_at = None
            os.kill(os.getpid(), signal.SIGINT)
        text = " ".join(f"w{k}" for k in range(i + 1))
        out = Out(self._req, (" " if i else "") + f"w{i}", text, i + 1 == self.words)
        if out.finished:
            self._req = None
        return [out]

    def abort(self, request_id):
        self.aborted.append(request_id)
        self._req = None

    def drain(self):
        self.drains += 1
        return []


def _run(engine, lines, system=None):
    out = io.StringIO()
    script = iter(lines)

    def read(prompt):
        out.write(prompt)
        try:
            return next(script)
        except StopIteration:
            raise EOFError from None

    session = ChatSession(engine, params=None, system=system, out=out)
    assert session.run(read) == 0
    return session, out.getvalue()


def test_replies_stream_and_the_history_grows():
    engine = FakeEngine(words=3)
    session, text = _run(engine, ["hi", "again"])
    assert text.count("w0 w1 w2\n") == 2
    assert engine.tokenizer.prompts[1] == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "w0 w1 w2"},
        {"role": "user", "content": "again"},
    ]
    assert engine.drains == 2  # nothing left in flight after each reply


def test_reset_and_help_say_what_they_did():
    engine = FakeEngine(words=2)
    session, text = _run(engine, ["one", "two", "/reset", "/help", "/nope", "three"], system="S")
    assert "conversation cleared: 2 turn(s) forgotten (the system prompt is kept)" in text
    assert HELP in text and "/reset" in HELP and "Ctrl-C" in HELP
    assert "unknown command /nope; /help lists the commands" in text
    assert engine.tokenizer.prompts[-1] == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "three"},
    ]


def test_exit_ends_the_session():
    engine = FakeEngine()
    _, text = _run(engine, ["/exit", "never sent"])
    assert engine.tokenizer.prompts == []


def test_ctrl_c_stops_the_reply_and_keeps_the_session():
    engine = FakeEngine(words=50, interrupt_at=2)
    previous = signal.getsignal(signal.SIGINT)
    session, text = _run(engine, ["tell me a long story", "and now?"])
    assert engine.aborted == ["req-0"]
    assert "[reply interrupted]" in text
    # The partial reply stays in the conversation and the next turn is answered in full.
    assert session.messages[1]["content"].startswith("w0 w1")
    assert len(session.messages[1]["content"].split()) < 50
    assert session.messages[3]["content"] == " ".join(f"w{k}" for k in range(50))
    assert signal.getsignal(signal.SIGINT) is previous  # the handler is put back


def test_ctrl_c_at_the_prompt_does_not_end_the_session():
    engine = FakeEngine(words=1)
    lines = iter(["first"])
    state = {"interrupted": False}

    def read(prompt):
        if not state["interrupted"]:
            state["interrupted"] = True
            raise KeyboardInterrupt
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    out = io.StringIO()
    assert ChatSession(engine, None, out=out).run(read) == 0
    assert "(Ctrl-D or /exit quits)" in out.getvalue() and "w0" in out.getvalue()


def test_sampling_defaults_prefer_the_models_generation_config():
    assert sampling_defaults({"temperature": 0.6, "top_p": 0.9})[0] == {
        "temperature": 0.6,
        "top_p": 0.9,
    }
    values, source = sampling_defaults({})
    assert values == FALLBACK_SAMPLING and values["temperature"] <= 0.3
    assert "no generation config" in source


def test_a_turn_that_does_not_fit_is_reported_and_dropped():
    class TooLong(FakeEngine):
        def add_request(self, request_id, prompt, params):
            raise ValueError("prompt has 3000 tokens; max_model_len=2048 leaves no room")

    session, text = _run(TooLong(), ["a very long message"])
    assert "error: prompt has 3000 tokens" in text and "/reset starts over" in text
    assert session.messages == []


def test_a_message_that_is_not_unicode_is_refused_and_the_session_goes_on():
    """Non-UTF-8 bytes on stdin arrive as lone surrogates; the tokenizer's TypeError ended the
    session (and its conversation) with a traceback."""
    engine = FakeEngine(words=2)
    session, text = _run(engine, ["a\udcffb", "fine"])
    assert "error: the message has a lone surrogate" in text
    assert engine.tokenizer.prompts == [[{"role": "user", "content": "fine"}]]


def test_no_stdin_ends_the_session_as_eof_does():
    def closed(prompt):
        raise RuntimeError("input(): lost sys.stdin")

    session = ChatSession(FakeEngine(), params=None, out=io.StringIO())
    assert session.run(closed) == 0
