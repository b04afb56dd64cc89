"""Text <-> token ids: a `tokenizers` backend, special tokens, the chat template, streaming decode.

Built from a Hugging Face directory (tokenizer.json + tokenizer_config.json) or, by the GGUF
loader, from a GGUF file's vocabulary. Encoding follows transformers' fast tokenizers:
`encode(text)` applies the backend's post-processor (which adds BOS where the model wants it); a
chat-templated prompt is encoded without it, because the template already writes BOS.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers
from tokenizers.decoders import DecodeStream


def _raise_template_error(message: str) -> None:
    raise ValueError(f"chat template error: {message}")


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson escapes HTML characters (<, >, &, '), which would change the prompt
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    """The environment transformers renders chat templates in, so prompts come out identical."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_template_error
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


@dataclasses.dataclass
class Tokenizer:
    backend: tokenizers.Tokenizer
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    unk_token: str | None = None
    pad_token: str | None = None

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def longest_token_bytes(self) -> int:
        """UTF-8 length of the vocabulary's longest token text, special tokens included: a
        text's length bounds its token count from below without encoding it."""
        pieces = self.backend.decode_batch(
            [[i] for i in range(self.vocab_size)], skip_special_tokens=False
        )
        return max(max((len(p.encode()) for p in pieces), default=1), 1)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render messages the way transformers' `apply_chat_template(tokenize=False)` does.

        As there, keys whose value is None are dropped from each message (OpenAI clients send
        `content=None` with tool calls), the special tokens are template variables, and extra
        keyword arguments (e.g. `enable_thinking=False`) reach the template.
        """
        if self.chat_template is None:
            raise ValueError("this model has no chat template; use generate() with a plain prompt")
        _check_messages(messages)
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        special = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "unk_token": self.unk_token,
            "pad_token": self.pad_token,
        }
        variables = {k: v for k, v in special.items() if v is not None} | template_kwargs
        try:
            template = _compile_template(self.chat_template)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"the model's chat template does not parse: {e}") from e
        return template.render(
            messages=messages,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        return self.encode(
            self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False
        )

    def to_state(self) -> dict[str, Any]:
        """Everything that makes this tokenizer, as plain data (another process rebuilds it with
        `from_state`)."""
        state = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        state["backend"] = self.backend.to_str()
        state["eos_token_ids"] = list(self.eos_token_ids)
        return state

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Tokenizer:
        state = dict(state)
        state["backend"] = tokenizers.Tokenizer.from_str(state["backend"])
        state["eos_token_ids"] = tuple(state["eos_token_ids"])
        return cls(**state)

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise ValueError(f"no tokenizer.json in {str(path)!r}")
        backend = tokenizers.Tokenizer.from_file(str(tok_file))
        config: dict[str, Any] = {}
        if (path / "tokenizer_config.json").is_file():
            config = json.loads((path / "tokenizer_config.json").read_text())
        gen_config: dict[str, Any] = {}
        if (path / "generation_config.json").is_file():
            gen_config = json.loads((path / "generation_config.json").read_text())
        bos_token = _token_str(config.get("bos_token"))
        eos_token = _token_str(config.get("eos_token"))
        bos_id = backend.token_to_id(bos_token) if bos_token else None
        eos_ids: list[int] = []
        if eos_token and backend.token_to_id(eos_token) is not None:
            eos_ids.append(backend.token_to_id(eos_token))
        gen_eos = gen_config.get("eos_token_id")
        for tid in (
            gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else []
        ):
            if tid not in eos_ids:
                eos_ids.append(int(tid))
        template = config.get("chat_template")
        if template is None and (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        return cls(
            backend,
            bos_id,
            tuple(eos_ids),
            template,
            bos_token,
            eos_token,
            unk_token=_token_str(config.get("unk_token")),
            pad_token=_token_str(config.get("pad_token")),
        )


def _token_str(token: Any) -> str | None:
    if isinstance(token, dict):
        return token.get("content")
    return token


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError(
            f"messages must be a non-empty list of role/content dicts, got {messages!r:.100}"
        )
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"each message needs 'role' and 'content', got {m!r:.100}")


class IncrementalDetokenizer:
    """Streams text as tokens arrive, one token at a time, in the tokenizers library's own
    incremental decoder (`tokenizers.decoders.DecodeStream`, Rust).

    Byte-level BPE pieces and sentencepiece's leading-space handling only decode right next to
    their neighbours, so the stream is first fed the prompt's last few tokens (their text is
    discarded); text that ends in an incomplete UTF-8 sequence is held back until a later token
    completes it. Each step costs one call into Rust (about 2 us) instead of two full decodes of a
    token window in Python.
    """

    CONTEXT_TOKENS = 6  # prompt tokens fed first, as context for the first output token

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True
    ):
        self._backend = tokenizer.backend
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        for token_id in prompt_ids[-self.CONTEXT_TOKENS :]:
            self._stream.step(self._backend, token_id)
        self._skip_special_tokens = skip_special_tokens
        self._pending: list[int] = []  # tokens since the last text: an incomplete UTF-8 tail
        self.text = ""

    def add(self, token_id: int) -> str:
        """Append one token; return the newly completed text (possibly empty)."""
        delta = self._stream.step(self._backend, token_id) or ""
        if delta:
            self._pending.clear()
            self.text += delta
        else:
            self._pending.append(token_id)
        return delta

    def flush(self) -> str:
        """At the end of the output: the text still held back, with U+FFFD for bytes that never
        completed a character, so the whole text is what decoding every token at once gives (a
        run of invalid bytes would otherwise produce no text at all)."""
        if not self._pending:
            return ""
        tail = self._backend.decode(self._pending, skip_special_tokens=self._skip_special_tokens)
        self._pending.clear()
        self.text += tail
        return tail
