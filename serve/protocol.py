"""Request bodies (pydantic): OpenAI's fields plus vLLM's extensions (top_k, ignore_eos, ...).

Strict, as the OpenAI API defines its types: no coercion (`"4"` is not a number, `"yes"` not a
boolean, `1e10` not an integer), no NaN or infinity, numbers within what the engine's arrays hold.
A field this server does not implement is refused (400 naming it) rather than ignored, so a client
never gets silently different behaviour; `user` is accepted because it changes no output. Each
field's range is in its type, so /openapi.json describes what is accepted; suffix and tools are
checked in convert.py. Sampling fields are nullable because some clients
send null for "default".
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field

from nori_jax.prompts import lone_surrogate
from nori_jax.sampling_params import (
    FLOAT32_MAX,
    INT32_MAX,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_VALUE,
    MAX_LOGPROBS,
    MAX_PRESENCE_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MIN_REPETITION_PENALTY,
)
from serve.choices import MAX_CHOICES, MAX_N


def unicode_text(s: str) -> str:
    """s, if it is Unicode text (prompts.lone_surrogate); else a ValueError saying why."""
    if (why := lone_surrogate(s)) is not None:
        raise ValueError(why)
    return s


Text = Annotated[str, AfterValidator(unicode_text)]  # every string that reaches the tokenizer
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
# A list of unbounded length stops at its first bad item: a body of a million bad items (or a
# batch tried against each member of the prompt's union) made millions of errors, whose listing
# held the event loop, and so every stream in flight, for seconds (40 s for one 8 MB body).
FailFast = Field(fail_fast=True)
TokenIds = Annotated[list[TokenId], FailFast]
# Lists of objects cost the event loop about 3 us an item to validate (0.9 s for the 250,000
# messages an 8 MB body holds, every stream of this API server stalled meanwhile), and pydantic
# checks a list's length only as it validates its items: their counts are checked first. A batch
# of prompts holds at most MAX_CHOICES (each is at least one choice, refused past that anyway).
# MAX_MESSAGES is a new limit, far past any real conversation but not past what a long context
# could hold (a message is a few template tokens at least): a longer chat is refused even where
# its tokens would fit, which bounds a body's validation to about 50 ms.
MAX_MESSAGES = 16384


def _batch_size(prompt: Any) -> Any:
    if isinstance(prompt, list) and len(prompt) > MAX_CHOICES and isinstance(prompt[0], str | list):
        raise ValueError(f"a batch of {len(prompt)} prompts; at most {MAX_CHOICES}")
    return prompt


def _chat_size(messages: Any) -> Any:
    if not isinstance(messages, list):
        return messages
    if len(messages) > MAX_MESSAGES:
        raise ValueError(f"{len(messages)} messages; at most {MAX_MESSAGES}")
    parts = sum(len(c) for m in messages if isinstance(c := _content(m), list))
    if parts > MAX_MESSAGES:
        raise ValueError(f"{parts} content parts in all; at most {MAX_MESSAGES}")
    return messages


def _content(message: Any) -> Any:
    return message.get("content") if isinstance(message, dict) else None


def stop_string(s: str) -> str:
    # (pydantic's own length check after a validator counts "items")
    if not 1 <= len(s) <= MAX_STOP_STRING_CHARS:
        raise ValueError(
            f"a stop string of {len(s)} characters; it needs 1 to {MAX_STOP_STRING_CHARS}"
        )
    return s


StopString = Annotated[
    Text,
    AfterValidator(stop_string),
    Field(json_schema_extra={"minLength": 1, "maxLength": MAX_STOP_STRING_CHARS}),
]
Stop = StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None
MaxTokens = Annotated[int, Field(ge=1, le=INT32_MAX)]
Temperature = Annotated[float, Field(ge=0.0, le=FLOAT32_MAX)]  # kept in a float32 array
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
TopK = Annotated[int, Field(ge=-1, le=INT32_MAX)]  # 0 or -1: off
MinP = Annotated[float, Field(ge=0.0, le=1.0)]  # 0: off
Seed = Annotated[int, Field(ge=0, le=INT32_MAX)]
MAX_DETOKENIZE_IDS = 2**20  # /detokenize: ids per request (the body's size bounds them too)
N = Annotated[int, Field(ge=1, le=MAX_N)]  # choices: sequences per request
# OpenAI's presence / frequency penalties; vLLM's repetition penalty (1: off) and min_tokens
Penalty = Annotated[float, Field(ge=-MAX_PRESENCE_PENALTY, le=MAX_PRESENCE_PENALTY)]
RepetitionPenalty = Annotated[float, Field(ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)]
MinTokens = Annotated[int, Field(ge=0, le=INT32_MAX)]
# vLLM's extension: lower runs first under the server's --scheduling-policy priority (else 0 only)
Priority = Annotated[int, Field(ge=-INT32_MAX - 1, le=INT32_MAX)]
# OpenAI's logit_bias: token ids (as JSON object keys, strings) -> a bias in [-100, 100]
LogitBias = Annotated[
    dict[
        Annotated[str, Field(pattern=r"^[0-9]{1,10}$")],
        Annotated[float, Field(ge=-MAX_LOGIT_BIAS_VALUE, le=MAX_LOGIT_BIAS_VALUE)],
    ],
    Field(max_length=MAX_LOGIT_BIAS),
]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False


class SamplingFields(_Body):
    """What /v1/completions and /v1/chat/completions share."""

    model: str | None = None
    n: N | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    seed: Seed | None = None
    stop: Stop = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: LogitBias | None = None
    user: str | None = None  # an end-user id for the caller's own records: no effect on output
    # vLLM extensions
    top_k: TopK | None = None
    min_p: MinP | None = None
    repetition_penalty: RepetitionPenalty | None = None
    min_tokens: MinTokens | None = None
    priority: Priority | None = None
    # vLLM's: each prompt token's logprob, rank and the k likeliest (not with stream)
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    ignore_eos: bool = False
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True


class CompletionRequest(SamplingFields):
    prompt: Annotated[
        Text | TokenIds | Annotated[list[Text], FailFast] | Annotated[list[TokenIds], FailFast],
        BeforeValidator(_batch_size),
    ]
    max_tokens: MaxTokens | None = 16
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool | None = False
    best_of: N | None = None  # equal to n: no ranking of extra samples
    suffix: Text | None = None


class ContentPart(BaseModel):
    # Other part types (images, audio) parse, so the answer can say they are not supported.
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: Text | None = None


class ChatMessage(_Body):
    role: Text
    content: Text | Annotated[list[ContentPart], FailFast] | None = None
    name: Text | None = None


ChatMessages = Annotated[
    list[ChatMessage], Field(min_length=1, fail_fast=True), BeforeValidator(_chat_size)
]


class ChatCompletionRequest(SamplingFields):
    messages: ChatMessages
    max_tokens: MaxTokens | None = None  # None: up to the model length
    max_completion_tokens: MaxTokens | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool | None = False
    # the most likely tokens per position, with `logprobs: true`
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: Annotated[list[dict[str, Any]], FailFast] | None = None
    # vLLM extensions
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(_Body):
    """/tokenize (vLLM's extension route): a text `prompt`, or chat `messages` rendered as the
    chat route renders them; one of the two."""

    model: str | None = None
    prompt: Text | None = None
    messages: ChatMessages | None = None
    add_generation_prompt: bool = True  # messages only
    add_special_tokens: bool | None = None  # None: True for a prompt, False for messages
    chat_template_kwargs: dict[str, Any] | None = None  # messages only


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: Annotated[TokenIds, Field(max_length=MAX_DETOKENIZE_IDS)]


class GenerateRequest(_Body):
    """/generate: the simple shape, with the sampling extras of the OpenAI routes."""

    prompt: Text | TokenIds
    max_tokens: MaxTokens = 16
    stream: bool = False
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    seed: Seed | None = None
    stop: Stop = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    min_tokens: MinTokens | None = None
    priority: Priority | None = None
    ignore_eos: bool = False
