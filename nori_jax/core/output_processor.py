"""Turns the engine core's raw outputs into `RequestOutput`s: deltas, text, stop strings.

Runs where the text is wanted (the API server process when serving, the caller's thread
offline), never inside the step loop. Per request it keeps the output token ids; text is made
incrementally only for requests that stream or have stop strings, and otherwise once, lazily, when
the finished output's `text` is first read. A stop string found here finishes the request: the
processor returns its id for the caller to abort in the core, holds the cut text, and emits the
final output when the core confirms the finish. An exception while handling one request's tokens
(its detokenizer, its stop strings) finishes that request alone the same way, with reason "error".
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable

from nori_jax.core.outputs import EngineCoreOutputs, FinishedRequest, RequestOutput
from nori_jax.core.top_logprob_rows import TopLogprobRows
from nori_jax.sampling_params import SamplingParams
from nori_jax.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclasses.dataclass(eq=False)
class _Stream:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool  # hand out deltas each step (else only the finished output)
    eos_token_ids: tuple[int, ...]
    detok: IncrementalDetokenizer | None = None
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] | None = None
    top_logprobs: list[tuple[tuple[int, float], ...]] | None = None  # logprobs >= 1
    # prompt_logprobs: set whole once the core has them all (RequestOutput's fields)
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[tuple[tuple[int, float], ...] | None] | None = None
    prompt_logprob_ranks: list[int | None] | None = None
    released: list[str] = dataclasses.field(default_factory=list)  # text pieces handed out
    held: str = ""  # text not yet released: it may be the start of a stop string
    max_stop_len: int = 0
    num_reported: int = 0  # output tokens already handed out
    num_pieces_reported: int = 0  # released text pieces already handed out
    stopped: bool = False  # a stop string (or an error) ended it; the core's finish is awaited
    # Final-only, and its tokens come whole with the core's FinishedRequest (add's
    # final_ids_from_core): `token_ids` stays empty until then.
    ids_at_finish: bool = False
    error: str | None = None  # handling its outputs raised: it ends with reason "error"


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None):
        self.tokenizer = tokenizer
        self._streams: dict[str, _Stream] = {}
        # The token lists of the streams that need nothing per token but the token itself
        # (final-only outputs, no text made while running, no logprobs): what `LLM.generate`
        # and `bench offline` ask for. `process` appends to these without touching the stream.
        self._plain: dict[str, list[int]] = {}
        # Streams that need nothing per token at all: plain ones whose tokens come with the
        # core's finish. A step whose rows are all theirs is not read row by row.
        self._at_finish = 0
        self._with_logprobs = 0  # streams that asked for logprobs: only then are they read

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._streams

    def __len__(self) -> int:
        return len(self._streams)

    def add(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_ids: tuple[int, ...] = (),
        stream: bool = True,
        final_ids_from_core: bool = False,
    ) -> None:
        """Register a request. `final_ids_from_core`: the core was sent it with
        `EngineCoreRequest.final_token_ids` (its FinishedRequest will carry the whole output)."""
        self.drop(request_id)
        s = _Stream(request_id, prompt, prompt_token_ids, params, stream, tuple(eos_token_ids))
        s.max_stop_len = max(map(len, params.stop), default=0)
        if self.tokenizer is not None and (stream or params.stop):
            s.detok = self._detokenizer(s)
        if params.logprobs is not None:
            s.logprobs = []
            self._with_logprobs += 1
        if params.logprobs:
            s.top_logprobs = []
        if params.prompt_logprobs is not None and len(prompt_token_ids) == 1:
            self._set_prompt_logprobs(s, [], [] if params.prompt_logprobs else None, [])
        self._streams[request_id] = s
        # Never stopped while running either: a stream stops only through its detokenizer or
        # its stop strings, and without a detokenizer a final-only stream checks neither.
        if not stream and s.detok is None and s.logprobs is None:
            if final_ids_from_core:
                s.ids_at_finish = True
                self._at_finish += 1
            else:
                self._plain[request_id] = s.token_ids

    def _detokenizer(self, s: _Stream) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(
            self.tokenizer, s.prompt_token_ids, s.params.skip_special_tokens
        )

    def process(self, outs: EngineCoreOutputs) -> tuple[list[RequestOutput], dict[str, str]]:
        """Apply one step's outputs: (user outputs, {request id: reason} of the requests this
        processor has ended: "stop" for a stop string, "error" for a failure of its own).

        The caller finishes those in the core with that reason; their final outputs come with the
        core's FinishedRequest, through `finish`.
        """
        streams = self._streams
        for rid, (values, tops, ranks) in outs.prompt_logprobs.items():
            if (s := streams.get(rid)) is not None:
                self._set_prompt_logprobs(s, values, tops, ranks)
        finished = {f.request_id: f for f in outs.finished}
        touched: dict[str, _Stream] = {}
        ended: dict[str, str] = {}
        top = _TopPairs(outs.top_logprobs) if outs.top_logprobs is not None else None
        plain = self._plain
        if self._at_finish == len(streams):
            rows = ()  # every stream takes its tokens from its finish: nothing per row
        else:
            lps = outs.logprobs  # a column: every row's, or none given (0.0 for those asking)
            if self._with_logprobs and len(lps):
                lp_column = lps.tolist()
            else:  # no Python float per row where no stream reads them
                lp_column = itertools.repeat(0.0, len(outs.request_ids))
            rows = zip(outs.request_ids, outs.token_ids.tolist(), lp_column, strict=True)
        for rid, tok, lp in rows:
            token_ids = plain.get(rid)
            if token_ids is not None:  # the common row: one dict lookup and an append
                token_ids.append(tok)
                continue
            s = streams.get(rid)
            if s is None or s.stopped or s.ids_at_finish:
                continue  # not ours, tokens sampled after a stop string, or taken at the finish
            s.token_ids.append(tok)
            if s.logprobs is not None:
                s.logprobs.append(lp)
                if s.top_logprobs is not None:
                    s.top_logprobs.append(top.take(rid, s.params.logprobs) if top else ())
            if s.detok is not None:
                f = finished.get(rid)
                try:
                    if not (f and f.finish_reason == "stop" and self._is_stop_token(s, tok)):
                        s.held += s.detok.add(tok)
                    # Checked token by token: a multi-step launch brings several tokens of a
                    # request at once, and the output ends at the one that completes the stop.
                    if s.params.stop and self._matches_stop(s) and self._cut_at_stop_string(s):
                        s.stopped = True
                        ended[rid] = "stop"
                except Exception as e:  # noqa: BLE001 - one request's failure stays its own
                    self._fail(s, e, ended)
                    continue
                touched[rid] = s
            elif s.stream:
                touched[rid] = s
        outputs = []
        for s in touched.values():
            if s.request_id in finished or s.stopped:
                continue  # its final output follows
            try:
                self._release(s)
                out = self._delta(s) if s.stream else None
            except Exception as e:  # noqa: BLE001
                self._fail(s, e, ended)
                continue
            if out is not None:
                outputs.append(out)
        for f in outs.finished:
            try:
                out = self.finish(f)
            except Exception as e:  # noqa: BLE001
                out = _failed_output(f, e)
            if out is not None:
                outputs.append(out)
        return outputs, ended

    @staticmethod
    def _set_prompt_logprobs(s: _Stream, values: list[float], tops, ranks: list[int]) -> None:
        """The prompt's logprobs as outputs hand them out: None for the first token."""
        s.prompt_logprobs = [None, *values]
        s.prompt_top_logprobs = None if tops is None else [None, *tops]
        s.prompt_logprob_ranks = [None, *ranks]

    @staticmethod
    def _fail(s: _Stream, e: Exception, ended: dict[str, str]) -> None:
        s.stopped, s.error = True, f"{type(e).__name__}: {e}"
        s.detok = None  # what it would still release is not trusted
        ended[s.request_id] = "error"

    def finish(self, f: FinishedRequest) -> RequestOutput | None:
        """The final output of a request the core has finished (None if not ours)."""
        s = self._streams.pop(f.request_id, None)
        if s is None:
            return None
        self._with_logprobs -= s.logprobs is not None
        self._plain.pop(f.request_id, None)
        if s.ids_at_finish:
            self._at_finish -= 1
            if f.token_ids is None:
                raise RuntimeError(
                    f"request {f.request_id!r}: added with final_ids_from_core, but its finish "
                    "carries no token ids (EngineCoreRequest.final_token_ids not set)"
                )
            s.token_ids = f.token_ids
        error = s.error or f.error
        reason = "error" if error else "stop" if s.stopped else f.finish_reason
        if s.detok is not None:
            if not s.stopped:  # a stop string's cut text is final; else check the tail once
                s.held += s.detok.flush()
                if self._matches_stop(s):
                    self._cut_at_stop_string(s)
            s.released.append(s.held)
            s.held = ""
        new_ids = s.token_ids[s.num_reported :] if s.stream else []
        out = RequestOutput(
            request_id=s.request_id,
            prompt=s.prompt,
            prompt_token_ids=s.prompt_token_ids,
            new_token_ids=new_ids,
            new_text="".join(s.released[s.num_pieces_reported :]) if s.stream else "",
            new_logprobs=_new(s.logprobs, s.num_reported),
            finished=True,
            finish_reason=reason,
            token_ids=s.token_ids,
            logprobs=s.logprobs,
            metrics=f.metrics,
            error=error,
            new_top_logprobs=_new(s.top_logprobs, s.num_reported),
            top_logprobs=s.top_logprobs,
            prompt_logprobs=s.prompt_logprobs,
            prompt_top_logprobs=s.prompt_top_logprobs,
            prompt_logprob_ranks=s.prompt_logprob_ranks,
        )
        if s.detok is not None or error:
            out._text = "".join(s.released)
        elif self.tokenizer is not None:
            out._decode = self._final_text(s, reason)
        else:
            out._text = ""
        return out

    def _final_text(self, s: _Stream, reason: str) -> Callable[[], str]:
        """Decode the whole output once, when its text is first read (the same text streaming
        would have produced)."""

        def decode() -> str:
            ids = s.token_ids
            if reason == "stop" and ids and self._is_stop_token(s, ids[-1]):
                ids = ids[:-1]
            detok = self._detokenizer(s)
            return "".join(detok.add(t) for t in ids) + detok.flush()

        return decode

    @staticmethod
    def _is_stop_token(s: _Stream, tok: int) -> bool:
        p = s.params
        return not p.include_stop_str_in_output and (
            tok in p.stop_token_ids or tok in s.eos_token_ids
        )

    @staticmethod
    def _release(s: _Stream) -> None:
        """Move the held text into the released pieces, but for a tail that may still be the
        start of a stop string."""
        hold = s.max_stop_len - 1
        cut = max(len(s.held) - hold, 0)
        if cut:
            s.released.append(s.held[:cut])
            s.held = s.held[cut:]

    @staticmethod
    def _delta(s: _Stream) -> RequestOutput | None:
        new_ids = s.token_ids[s.num_reported :]
        text = "".join(s.released[s.num_pieces_reported :])
        if not new_ids and not text:
            return None
        new_lp = _new(s.logprobs, s.num_reported)
        new_top = _new(s.top_logprobs, s.num_reported)
        s.num_reported = len(s.token_ids)
        s.num_pieces_reported = len(s.released)
        return RequestOutput(
            request_id=s.request_id,
            prompt=s.prompt,
            prompt_token_ids=s.prompt_token_ids,
            new_token_ids=new_ids,
            new_text=text,
            new_logprobs=new_lp,
            finished=False,
            finish_reason=None,
            new_top_logprobs=new_top,
            prompt_logprobs=s.prompt_logprobs,
            prompt_top_logprobs=s.prompt_top_logprobs,
            prompt_logprob_ranks=s.prompt_logprob_ranks,
        )

    @staticmethod
    def _matches_stop(s: _Stream) -> bool:
        """Are stop strings matched yet? Only once more than `min_tokens` tokens are out (vLLM's
        rule): text from before then is released unchecked."""
        return len(s.token_ids) > s.params.min_tokens

    @staticmethod
    def _cut_at_stop_string(s: _Stream) -> bool:
        """Find the earliest stop string in the unreleased text; on a match keep the text up to
        it (or through it, with include_stop_str_in_output)."""
        best, best_stop = -1, ""
        for stop in s.params.stop:
            i = s.held.find(stop)
            if i >= 0 and (best < 0 or i < best):
                best, best_stop = i, stop
        if best < 0:
            return False
        keep = best + len(best_stop) if s.params.include_stop_str_in_output else best
        s.held = s.held[:keep]
        return True

    def drop(self, request_id: str) -> None:
        """Forget a request without an output (its caller has gone)."""
        s = self._streams.pop(request_id, None)
        self._plain.pop(request_id, None)
        if s is not None and s.ids_at_finish:
            self._at_finish -= 1
        if s is not None and s.logprobs is not None:
            self._with_logprobs -= 1


class _TopPairs:
    """A step's top-logprob rows (TopLogprobRows) as (id, logprob) pairs, made in one pass over
    the block; each request then takes its own `logprobs` of its row's pairs."""

    __slots__ = ("width", "by_request")

    def __init__(self, block: TopLogprobRows):
        self.width = block.width
        self.by_request = block.pairs()

    def take(self, request_id: str, k: int) -> tuple[tuple[int, float], ...]:
        """The request's k (id, logprob) pairs, once: none if none came, or for a second token
        of the request in the step (a block has one row a request: top logprobs never run in a
        multi-step launch)."""
        pairs = self.by_request.pop(request_id, ())
        return pairs if k >= self.width else pairs[:k]


def _new(values: list | None, reported: int) -> list | None:
    """The per-token values (logprobs, top logprobs) not yet handed out, if the request has them."""
    return values[reported:] if values is not None else None


def _failed_output(f: FinishedRequest, e: Exception) -> RequestOutput:
    """The final output of a request whose own final output could not be made."""
    out = RequestOutput(
        request_id=f.request_id,
        prompt=None,
        prompt_token_ids=[],
        new_token_ids=[],
        new_text="",
        new_logprobs=None,
        finished=True,
        finish_reason="error",
        token_ids=[],
        metrics=f.metrics,
        error=f"{type(e).__name__}: {e}",
    )
    out._text = ""
    return out
