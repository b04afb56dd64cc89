"""POST /tokenize and /detokenize, vLLM's extension routes: the token ids the engine would see for
a text or for chat messages (rendered as /v1/chat/completions renders them), and the text of ids;
GET /tokenizer_info, the tokenizer's special tokens and chat template (what lm-evaluation-harness's
remote tokenizer reads, so an evaluation needs no copy of the tokenizer).

    {"prompt": "Hello"}                         -> {"count": 2, "max_model_len": 2048,
    {"messages": [...]}                             "tokens": [...], "token_strs": null}
    {"tokens": [...]}  (/detokenize)            -> {"prompt": "Hello"}

Tokenizing runs in a worker thread, never on the event loop; a text too long for the model is
refused before it is tokenized, as on the generation routes.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from nori_jax.prompts import check_text_length
from nori_jax.sampling_params import ParameterError
from serve import convert
from serve.context import ServeContext, get_context
from serve.errors import bad_request, parameter_error
from serve.protocol import DetokenizeRequest, TokenizeRequest

router = APIRouter()


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> JSONResponse:
    ctx = get_context(request)
    convert.check_model(ctx, body.model)
    ids = await asyncio.to_thread(_token_ids, ctx, body)
    return JSONResponse(
        {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids, "token_strs": None}
    )


def _token_ids(ctx: ServeContext, body: TokenizeRequest) -> list[int]:
    if body.prompt is not None and body.messages is not None:
        raise bad_request("give either prompt (a text) or messages (a chat), not both", "prompt")
    if body.prompt is None and body.messages is None:
        raise bad_request("give prompt (a text) or messages (a chat)", "prompt")
    if body.messages is not None:
        convert.check_chat_template(ctx)
        try:
            return convert.chat_prompt(ctx, body, bool(body.add_special_tokens))
        except ParameterError as e:  # messages longer than the model can hold
            raise parameter_error(e, "messages") from None
    chat_only = sorted({"add_generation_prompt", "chat_template_kwargs"} & body.model_fields_set)
    if chat_only:  # they shape a chat's rendering: with a text prompt they would do nothing
        raise bad_request(f"{chat_only[0]} applies to messages, not to a prompt", chat_only[0])
    tok = _tokenizer(ctx, "prompt")
    try:
        check_text_length(tok, body.prompt, ctx.max_model_len)
    except ParameterError as e:
        raise parameter_error(e, "prompt") from None
    special = True if body.add_special_tokens is None else body.add_special_tokens
    return tok.encode(body.prompt, add_special_tokens=special)


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> JSONResponse:
    ctx = get_context(request)
    convert.check_model(ctx, body.model)
    tok = _tokenizer(ctx, "tokens")
    vocab = tok.vocab_size
    if body.tokens and max(body.tokens) >= vocab:
        bad = next(t for t in body.tokens if t >= vocab)
        raise bad_request(f"token id {bad} is outside the vocabulary [0, {vocab})", "tokens")
    text = await asyncio.to_thread(tok.decode, body.tokens, False)
    return JSONResponse({"prompt": text})


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request) -> JSONResponse:
    ctx = get_context(request)
    tok = _tokenizer(ctx, "model")
    return JSONResponse(
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": tok.bos_token,
            "eos_token": tok.eos_token,
            "unk_token": tok.unk_token,
            "pad_token": tok.pad_token,
            "bos_token_id": tok.bos_token_id,
            "eos_token_ids": list(tok.eos_token_ids),
            "model_max_length": ctx.max_model_len,
            "vocab_size": tok.vocab_size,
            "chat_template": tok.chat_template,
        }
    )


def _tokenizer(ctx: ServeContext, param: str) -> Any:
    if ctx.tokenizer is None:
        raise bad_request("this model has no tokenizer", param)
    return ctx.tokenizer
