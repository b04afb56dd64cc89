"""POST /v1/completions: one prompt (text or token ids) or a batch of them, `n` choices of each
(choice i * n + j is prompt i's j-th), streamed as SSE or answered whole."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from nori_jax.core.outputs import RequestOutput
from nori_jax.sampling_params import ParameterError, SamplingParams
from serve import convert, generation
from serve.choices import Choices
from serve.context import get_context
from serve.errors import bad_request, parameter_error
from serve.protocol import CompletionRequest
from serve.responses import (
    completion_logprobs,
    new_logprobs,
    stage_metrics,
    token_strings,
    usage,
    vllm_prompt_logprobs,
    whole_answer,
)
from serve.streaming import SSE_DONE, sse, stream_events

router = APIRouter()


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    return await generation.handle(Completion(get_context(request), body), request)


class Completion(generation.GenerationRoute):
    id_prefix = "cmpl"
    body: CompletionRequest

    def check(self) -> None:
        convert.check_unsupported(self.body)
        self._prompts = convert.completion_prompts(self.body, self.n)
        self._prompt = self._prompts[0]
        self._echoes = [""] * len(self._prompts)  # each prompt's echo (its choices' text start)

    @property
    def num_choices(self) -> int:
        return self.n * len(self._prompts)

    def prepare_all(self) -> list[tuple[list[int], SamplingParams]]:
        convert.check_model(self.ctx, self.body.model)
        self.check()
        prepared = []
        for i, prompt in enumerate(self._prompts):
            self._prompt = prompt
            param = self.prompt_param if len(self._prompts) == 1 else f"prompt.{i}"
            try:
                ids = self.prompt_ids()
                prepared.append((ids, self.sampling_params(len(ids))))
            except ParameterError as e:
                raise parameter_error(e, param) from None
            self._echoes[i] = self._echo
        return prepared

    def prepare(self) -> tuple[list[int], SamplingParams]:
        """One prompt's (a batch job's line answers one)."""
        prepared = self.prepare_all()
        if len(prepared) != 1:
            raise bad_request(
                f"{len(prepared)} prompts: a batch job's line takes one (write a line each)",
                "prompt",
            )
        return prepared[0]

    def prompt_ids(self) -> list[int]:
        ids = self.ctx.engine.tokenize(self._prompt)
        # `echo`: every choice's text starts with the prompt (token ids as the tokenizer decodes
        # them), as OpenAI's legacy completions and vLLM answer it
        prompt, tok = self._prompt, self.ctx.tokenizer
        if not self.body.echo:
            self._echo = ""
        elif isinstance(prompt, str):
            self._echo = prompt
        elif tok is None:
            self._echo = "".join(token_strings(tok, ids))
        else:
            self._echo = tok.decode(ids, skip_special_tokens=self.body.skip_special_tokens)
        return ids

    def logprobs(self) -> int | None:
        return self.body.logprobs

    def prompt_logprobs(self) -> int | None:
        # echo with logprobs: the echoed prompt's tokens come with theirs, as OpenAI's legacy
        # completions answer (lm-evaluation-harness scores texts this way); and vLLM's field
        asked = [k for k in (self.body.logprobs if self.body.echo else None,
                             self.body.prompt_logprobs) if k is not None]  # fmt: skip
        return max(asked) if asked else None

    def answer(self, head: dict[str, Any], outs: list[RequestOutput]) -> dict[str, Any]:
        choices = []
        for index, out in enumerate(outs):
            echo = self._echoes[index // self.n]
            logprobs = None
            if out.logprobs is not None:
                if echo:
                    logprobs = self._prompt_logprobs(out)
                part = completion_logprobs(
                    self.ctx.tokenizer, out.token_ids, out.logprobs, len(echo), out.top_logprobs
                )
                logprobs = part if logprobs is None else _joined(logprobs, part)
            choice = _choice(index, echo + out.text, logprobs, out.finish_reason)
            if self.body.prompt_logprobs is not None:
                choice["prompt_logprobs"] = vllm_prompt_logprobs(
                    self.ctx.tokenizer, out, self.body.prompt_logprobs
                )
            choices.append(choice)
        return whole_answer(head, "text_completion", choices, outs, self.n)

    def _prompt_logprobs(self, out: RequestOutput) -> dict[str, Any]:
        """The legacy logprobs object of the echoed prompt: its first token has none (null)."""
        ids, values, tops = out.prompt_token_ids, out.prompt_logprobs, out.prompt_top_logprobs
        if values is None:  # (the engine computes them for every echo with logprobs)
            raise RuntimeError(f"request {out.request_id}: no prompt logprobs came back")
        tok, k = self.ctx.tokenizer, self.body.logprobs
        first = token_strings(tok, ids[:1])
        tops = None if tops is None or not k else [t[:k] for t in tops[1:]]
        rest = completion_logprobs(tok, ids[1:], values[1:], len(first[0]), tops)
        return {
            "tokens": first + rest["tokens"],
            "token_logprobs": [None, *rest["token_logprobs"]],
            "top_logprobs": None if tops is None else [None, *rest["top_logprobs"]],
            "text_offset": [0, *rest["text_offset"]],
        }

    def events(self, head: dict[str, Any], choices: Choices) -> AsyncIterator[bytes]:
        ctx, body = self.ctx, self.body
        head = head | {"object": "text_completion"}
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        want_logprobs = body.logprobs is not None
        extra = {"usage": None} if include_usage else {}
        text_offsets = [0] * len(choices)  # per choice: where its next text starts
        final: dict[int, RequestOutput] = {}  # by choice index

        def events(index: int, out: RequestOutput) -> Iterable[bytes]:
            if echo_later[index]:  # the prompt with its logprobs, once the engine has them
                echo_later[index] = False
                echo = self._echoes[index // self.n]
                text_offsets[index] = len(echo)
                prompt = self._prompt_logprobs(out)
                yield sse(head | {"choices": [_choice(index, echo, prompt)]} | extra)
            if not (out.new_text or out.finished or (want_logprobs and out.new_token_ids)):
                return  # text held back (it may start a stop string): nothing to say yet
            logprobs = None
            if want_logprobs:
                logprobs = completion_logprobs(
                    ctx.tokenizer,
                    out.new_token_ids,
                    new_logprobs(out),
                    text_offsets[index],
                    out.new_top_logprobs,
                )
            text_offsets[index] += len(out.new_text)
            finish = out.finish_reason if out.finished else None
            chunk = head | {"choices": [_choice(index, out.new_text, logprobs, finish)]} | extra
            if out.finished:
                final[index] = out
                chunk["metrics"] = stage_metrics(out)
            yield sse(chunk)

        def tail() -> Iterable[bytes]:
            if include_usage and len(final) == len(choices):
                outs = [final[i] for i in sorted(final)]
                yield sse(head | {"choices": [], "usage": usage(outs, self.n)})
            yield SSE_DONE

        # `echo`: each choice's first chunk is the prompt, at once, or with logprobs as soon as
        # its first output brings them
        echo_of = [self._echoes[i // self.n] for i in range(len(choices))]
        echo_later = [bool(echo) and want_logprobs for echo in echo_of]
        echoed = [
            sse(head | {"choices": [_choice(i, echo)]} | extra)
            for i, echo in enumerate(echo_of)
            if echo and not want_logprobs
        ]
        return stream_events(
            choices, events, head=echoed, tail=tail, retry_after_s=ctx.settings.retry_after_s
        )


def _choice(
    index: int, text: str, logprobs: dict | None = None, finish_reason: str | None = None
) -> dict[str, Any]:
    """A choice of a completion, or of one of its streamed chunks."""
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def _joined(first: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    """Two legacy logprobs objects of consecutive tokens as one."""
    tops = None
    if first["top_logprobs"] is not None or then["top_logprobs"] is not None:
        tops = (first["top_logprobs"] or []) + (then["top_logprobs"] or [])
    return {
        "tokens": first["tokens"] + then["tokens"],
        "token_logprobs": first["token_logprobs"] + then["token_logprobs"],
        "top_logprobs": tops,
        "text_offset": first["text_offset"] + then["text_offset"],
    }
