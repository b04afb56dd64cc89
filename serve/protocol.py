"""Request bodies (pydantic): OpenAI's fields plus vLLM's extensions (top_k, ignore_eos, ...).

Unknown fields are ignored, as vLLM and OpenAI do (clients send `user`, `metadata`, ...). Sampling
fields are nullable because some clients send null for "default". Fields we parse but do not
implement (penalties, logit_bias, echo, best_of, tools) are rejected in convert.py unless they
hold their neutral value, so a client never gets silently different behaviour.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class SamplingFields(_Body):
    """What /v1/completions and /v1/chat/completions share."""

    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM extensions
    top_k: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # None: up to the model length
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    # vLLM extensions
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class GenerateRequest(_Body):
    """/generate: the simple shape, with the sampling extras of the OpenAI routes."""

    prompt: str | list[int]
    max_tokens: int = 16
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
