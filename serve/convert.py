"""Validated request bodies -> (prompt token ids, SamplingParams), or a 400/404 ApiError.

Everything that can be checked before the engine sees the request is checked here, so a bad
request costs the engine nothing and can never disturb the requests in flight. Errors carry their
field as data: `ParameterError.param`, or the `param` given to `bad_request`.
"""

from __future__ import annotations

from typing import Any

import jinja2

from nori_jax.prompts import check_text_length
from nori_jax.sampling_params import SamplingParams
from serve.choices import MAX_CHOICES
from serve.context import ServeContext
from serve.errors import ApiError, bad_request
from serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    SamplingFields,
    unicode_text,
)


def check_model(ctx: ServeContext, model: str | None) -> None:
    if model is not None and model != ctx.settings.model_name:
        raise ApiError(
            404,
            f"the model {model!r} does not exist; this server serves {ctx.settings.model_name!r}",
            "not_found_error",
            "model",
            "model_not_found",
        )


def check_unsupported(req: SamplingFields) -> None:
    """Reject what we parse but do not implement, or not together."""
    if req.stream and req.prompt_logprobs is not None:
        raise bad_request(
            "prompt_logprobs is not available with stream (vLLM's rule; completions' echo with "
            "logprobs streams the prompt's logprobs)",
            "prompt_logprobs",
        )
    best_of = getattr(req, "best_of", None)
    if best_of is not None and best_of != (req.n or 1):
        raise bad_request(
            f"best_of={best_of} must equal n={req.n or 1}: ranking extra samples is not supported",
            "best_of",
        )


def completion_prompts(req: CompletionRequest, n: int) -> list[str | list[int]]:
    """The request's prompts, as texts or token ids: one (a text, or a list of ids), or a batch
    (a list of texts, or of id lists), each answered with `n` choices; at most MAX_CHOICES
    choices in all (each is a sequence in the engine's batch)."""
    if req.suffix:
        raise bad_request("suffix is not supported", "suffix")
    prompt = req.prompt
    batch = isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list))
    prompts = list(prompt) if batch else [prompt]
    if len(prompts) * n > MAX_CHOICES:
        raise bad_request(
            f"{len(prompts)} prompts x n={n} = {len(prompts) * n} choices; at most {MAX_CHOICES} "
            "per request",
            "prompt",
        )
    return prompts


def check_chat(ctx: ServeContext, req: ChatCompletionRequest) -> None:
    if req.tools:
        raise bad_request("tools are not supported", "tools")
    check_chat_template(ctx)


def check_chat_template(ctx: ServeContext) -> None:
    """The model can render messages: it has a tokenizer and a chat template."""
    if ctx.tokenizer is None:
        raise bad_request("this model has no tokenizer, so it cannot chat", "messages")
    if ctx.tokenizer.chat_template is None:
        raise bad_request(
            "this model has no chat template; start the server with --chat-template FILE",
            "messages",
        )


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            for j, p in enumerate(content):
                where = f"messages.{i}.content.{j}"
                if p.type != "text":
                    raise bad_request("only text content parts are supported", where)
                if p.text is None:
                    raise bad_request("a text content part needs its text", where)
            content = "".join(p.text or "" for p in content)
        msg = {"role": m.role, "content": content if content is not None else ""}
        if m.name is not None:
            msg["name"] = m.name
        messages.append(msg)
    return messages


# apply_chat_template's own arguments: set by the request's fields, never by its kwargs
RESERVED_TEMPLATE_ARGS = frozenset({"messages", "add_generation_prompt"})
# Names the renderer's Python signatures take for themselves (Tokenizer.apply_chat_template's and
# jinja's Template.render's `self`): as a kwarg, a TypeError naming Python internals
RENDERER_ARGS = frozenset({"self"})


def chat_prompt(
    ctx: ServeContext, req: ChatCompletionRequest, add_special_tokens: bool = False
) -> list[int]:
    """Render the messages through the chat template and encode them (blocking: run it off the
    event loop). Messages far too long for the model are refused before rendering. `req` is any
    body with `messages`, `add_generation_prompt` and `chat_template_kwargs`."""
    tok = ctx.tokenizer
    assert tok is not None  # check_chat
    messages = chat_messages(req)
    check_text_length(tok, "".join(m["content"] for m in messages), ctx.max_model_len)
    kwargs = req.chat_template_kwargs or {}
    taken = sorted(RESERVED_TEMPLATE_ARGS & kwargs.keys())
    if taken:
        raise bad_request(
            f"chat_template_kwargs may not set {taken}: the request's own fields do",
            "chat_template_kwargs",
        )
    if reserved := sorted(RENDERER_ARGS & kwargs.keys()):
        raise bad_request(
            f"chat_template_kwargs may not set {reserved}: a name the template renderer reserves",
            "chat_template_kwargs",
        )
    try:
        text = tok.apply_chat_template(messages, req.add_generation_prompt, **kwargs)
    except (ValueError, TypeError, jinja2.TemplateError) as e:
        # The template's own checks (roles, alternation) and bad chat_template_kwargs: the
        # request's fault, not the server's.
        raise bad_request(f"cannot apply the chat template: {e}", "messages") from None
    except RecursionError:  # a value nested too deeply for the template's tojson
        raise bad_request(
            "cannot apply the chat template: a value in chat_template_kwargs is nested too "
            "deeply to render",
            "chat_template_kwargs",
        ) from None
    try:  # the messages are checked (protocol.Text); a template's own strings are not
        unicode_text(text)
    except ValueError as e:
        raise bad_request(f"the rendered chat prompt {e}", "chat_template_kwargs") from None
    check_text_length(tok, text, ctx.max_model_len)
    return tok.encode(text, add_special_tokens=add_special_tokens)


def max_new_tokens(
    ctx: ServeContext, prompt_len: int, requested: int | None, param: str, prompt_param: str
) -> int:
    """The generation budget: what was asked for, which must fit the model length with the prompt;
    None asks for all the room there is."""
    limit = ctx.max_model_len
    if prompt_len >= limit:
        raise bad_request(
            f"the prompt has {prompt_len} tokens; this model's maximum context "
            f"length is {limit} tokens",
            prompt_param,
        )
    if requested is None:
        return limit - prompt_len
    if requested < 1:
        raise bad_request(f"{param}={requested} must be >= 1", param)
    if prompt_len + requested > limit:
        raise bad_request(
            f"this model's maximum context length is {limit} tokens; the prompt has "
            f"{prompt_len} and {param}={requested} asks for {requested} more",
            param,
        )
    return requested


def sampling_params(
    req: SamplingFields | GenerateRequest,
    max_tokens: int,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """ParameterError (a 400 naming the field) for settings the engine cannot take."""
    extra: dict[str, Any] = {}
    if isinstance(req, SamplingFields):
        extra = dict(
            stop_token_ids=req.stop_token_ids,
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens,
            # keys are digit strings (protocol.py); SamplingParams checks the id range
            logit_bias={int(t): b for t, b in req.logit_bias.items()} if req.logit_bias else None,
        )
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=0 if req.top_k is None else req.top_k,
        min_p=0.0 if req.min_p is None else req.min_p,
        seed=req.seed,
        stop=req.stop,
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        min_tokens=req.min_tokens or 0,
        **extra,
    )
