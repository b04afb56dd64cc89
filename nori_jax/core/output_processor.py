"""Turns token ids into streamed text on the host: incremental detokenization and stop strings."""

from __future__ import annotations

import dataclasses

from nori_jax.core.outputs import RequestMetrics, RequestOutput
from nori_jax.core.request import Request
from nori_jax.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclasses.dataclass
class _Stream:
    request: Request
    prompt: str | None
    detok: IncrementalDetokenizer | None
    text: str = ""
    released: int = 0  # characters of `text` already handed out
    num_tokens_seen: int = 0  # output tokens already detokenized
    num_tokens_reported: int = 0  # output tokens already handed out


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None):
        self.tokenizer = tokenizer
        self._streams: dict[str, _Stream] = {}

    def add(self, req: Request, prompt: str | None) -> None:
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(
                self.tokenizer, req.prompt_token_ids, req.params.skip_special_tokens
            )
        self._streams[req.request_id] = _Stream(req, prompt, detok)

    def detokenize(self, req: Request) -> bool:
        """Extend the request's text with its new tokens; True if a stop string now ends it."""
        s = self._streams[req.request_id]
        new_ids = req.output_token_ids[s.num_tokens_seen :]
        s.num_tokens_seen = len(req.output_token_ids)
        if s.detok is None:
            return False
        p = req.params
        if (
            req.finish_reason == "stop"
            and new_ids
            and not p.include_stop_str_in_output
            and (new_ids[-1] in p.stop_token_ids or new_ids[-1] in req.eos_token_ids)
        ):
            new_ids = new_ids[:-1]  # the stop token itself is not part of the text
        for tok in new_ids:
            s.text += s.detok.add(tok)
        return not req.is_finished and self._cut_at_stop_string(s)

    def _cut_at_stop_string(self, s: _Stream) -> bool:
        stops = s.request.params.stop
        if not stops:
            return False
        # Text before `released` was checked in earlier steps; a new match can only start after
        # released - (longest stop - 1).
        start = max(s.released - max(map(len, stops)) + 1, 0)
        for stop in stops:
            i = s.text.find(stop, start)
            if i >= 0:
                s.text = s.text[
                    : i + len(stop) if s.request.params.include_stop_str_in_output else i
                ]
                return True
        return False

    def output(self, req: Request) -> RequestOutput:
        """The request's output so far; the stream is dropped once the request has finished."""
        s = self._streams[req.request_id]
        finished = req.is_finished
        hold = 0
        if not finished and req.params.stop:
            hold = max(map(len, req.params.stop)) - 1  # the tail may be the start of a stop string
        release_to = max(s.released, len(s.text) - hold)
        new_text = s.text[s.released : release_to]
        s.released = release_to
        new_ids = req.output_token_ids[s.num_tokens_reported :]
        s.num_tokens_reported = len(req.output_token_ids)
        if finished:
            del self._streams[req.request_id]
        return RequestOutput(
            request_id=req.request_id,
            prompt=s.prompt,
            prompt_token_ids=req.prompt_token_ids,
            token_ids=list(req.output_token_ids),
            text=s.text[: s.released],
            finished=finished,
            finish_reason=req.finish_reason,
            new_token_ids=new_ids,
            new_text=new_text,
            logprobs=list(req.output_logprobs) if req.params.logprobs is not None else None,
            metrics=RequestMetrics.of(req),
        )
