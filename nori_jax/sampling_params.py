"""Per-request sampling settings, with vLLM's field names. None changes a compiled program.

`validate()` is the engine's boundary for them: every number must fit the array the engine keeps it
in (int32 token ids, seeds and top-k, float32 temperature and top-p), and the stop conditions are
bounded, so no setting can overflow an array of the step loop or make one request's stop-string
matching slow the others. A bad value raises `ParameterError`, which names the field.
"""

from __future__ import annotations

import dataclasses

import numpy as np

# logprobs: the sampled token's logprob (0) and up to this many most likely tokens with theirs
# (vLLM's default max_logprobs; the step returns that many for each row that asks).
MAX_LOGPROBS = 20
INT32_MAX = 2**31 - 1
FLOAT32_MAX = 3.4028234663852886e38
# Stop strings are matched against each new piece of text of the request, stop token ids against
# each new token: bounded, so their cost stays a small multiple of a plain request's.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
# logit_bias: token id -> a bias added to its logit before sampling, as OpenAI's API bounds it.
# Entries travel in the step's buffer (core/step_layout.py, LOGIT_BIAS_CAPACITY for all rows).
MAX_LOGIT_BIAS = 256
MAX_LOGIT_BIAS_VALUE = 100.0
# Penalties on tokens already in the request (vLLM's formulas, sampler.apply_penalties): OpenAI's
# range for presence / frequency; repetition divides a positive logit and multiplies a negative
# one, bounded so that neither can overflow float32 (logits are within a few hundred).
MAX_PRESENCE_PENALTY = 2.0
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
# n: samples of one prompt, each a request of its own (sample_choices); past this, a caller means
# a bug, not a batch (the HTTP server bounds a request's choices lower, serve/choices.py).
MAX_N = 4096


class ParameterError(ValueError):
    """A request's setting is out of range; `param` is the field's name, `str()` says why."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclasses.dataclass
class SamplingParams:
    """How one request samples and when it stops.

    temperature 0 is greedy, and so is any temperature below 1e-5 (vLLM's rule: dividing the
    logits by much less overflows float32). top_k 0 or -1 disables top-k; top_p 1.0 disables
    top-p; min_p keeps the tokens at least min_p times as likely as the most likely one (0
    disables it; applied after temperature and before top-k / top-p, as vLLM does).
    `logit_bias` maps token ids to a bias in [-100, 100] added to their logits before anything
    else (greedy too; logprobs are then those of the biased logits). `seed` makes a request's
    sampled tokens reproducible whatever else runs beside it. `logprobs` returns the
    log-probability of each sampled token under the model's unscaled distribution (after
    logit_bias and penalties), and with logprobs = k >= 1 also the k most likely tokens with
    theirs.

    Penalties (vLLM's, applied after logit_bias and before temperature): `repetition_penalty`
    (1 = off) divides the positive logits and multiplies the negative ones of every token in the
    prompt or the output so far; `frequency_penalty` subtracts itself times the number of times a
    token was generated, `presence_penalty` itself once for any generated token (0 = off; negative
    values favour repetition). `min_tokens`: no EOS or stop token id can be sampled, and no stop
    string is matched, before that many tokens are generated.

    `n` (vLLM's): independent samples of the prompt. The offline API queues them as n requests
    (`sample_choices`: sample j seeded with seed + j where a seed is given) and returns each as
    an output of its own, `RequestOutput.index` j; with prefix caching (the default) the prompt
    is computed once, the others waiting for its pages in the cache. The engine itself takes
    n = 1 only.

    `prompt_logprobs` (vLLM's): each prompt token's logprob given the tokens before it, under the
    model's raw distribution (no logit_bias or penalty), and with k >= 1 the k most likely tokens
    at each position with theirs (`RequestOutput.prompt_logprobs`, `prompt_top_logprobs`, and
    each token's rank at its position, `prompt_logprob_ranks`; the first token has none).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    min_p: float = 0.0
    logit_bias: dict[int, float] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    prompt_logprobs: int | None = None
    n: int = 1

    @property
    def has_penalties(self) -> bool:
        """Does sampling depend on the request's earlier tokens (a penalty is on)?"""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
        )

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Bring the settings to their canonical form (a stop string into a list, None lists
        empty, top_k -1 to 0, numpy scalars to Python numbers), then raise ParameterError naming
        the first setting the engine cannot hold. The engine calls it again at submission, so a
        field set after construction is held to the same rules as one given to it."""
        self._normalize()
        _check_n(self.n)
        if not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= INT32_MAX:
            raise ParameterError(
                "max_tokens", f"max_tokens={self.max_tokens!r} must be an integer in [1, 2**31)"
            )
        t = self.temperature
        if not _is_number(t) or not 0.0 <= t <= FLOAT32_MAX:  # NaN fails both comparisons
            raise ParameterError(
                "temperature",
                f"temperature={t!r} must be a number in [0, 3.4e38] (float32's range)",
            )
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ParameterError("top_p", f"top_p={self.top_p!r} must be in (0, 1]")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ParameterError("min_p", f"min_p={self.min_p!r} must be in [0, 1]")
        if not _is_int(self.top_k) or not 0 <= self.top_k <= INT32_MAX:
            raise ParameterError(
                "top_k",
                f"top_k={self.top_k!r} must be 0 or -1 (disabled) or a positive integer < 2**31",
            )
        if self.seed is not None and not (_is_int(self.seed) and 0 <= self.seed <= INT32_MAX):
            raise ParameterError("seed", f"seed={self.seed!r} must be an integer in [0, 2**31)")
        if self.logprobs is not None and not (
            _is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise ParameterError(
                "logprobs",
                f"logprobs={self.logprobs!r} must be an integer in [0, {MAX_LOGPROBS}] (0: the "
                "sampled token's logprob only; k: also the k most likely tokens)",
            )
        if self.prompt_logprobs is not None and not (
            _is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            raise ParameterError(
                "prompt_logprobs",
                f"prompt_logprobs={self.prompt_logprobs!r:.50} must be an integer in "
                f"[0, {MAX_LOGPROBS}]",
            )
        self._validate_stops()
        self._validate_logit_bias()
        self._validate_penalties()
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ParameterError(name, f"{name}={getattr(self, name)!r} must be a boolean")

    def _normalize(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, np.generic):  # np.float32(0.5), np.int64(5): a number
                setattr(self, field.name, value.item())
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) and self.stop is not None:
            raise ParameterError(
                "stop", f"stop={self.stop!r:.200} must be a string or a list of them"
            )
        if not isinstance(self.stop_token_ids, (list, tuple)) and self.stop_token_ids is not None:
            raise ParameterError(
                "stop_token_ids", f"stop_token_ids={self.stop_token_ids!r:.200} must be a list"
            )
        self.stop = list(self.stop or [])
        self.stop_token_ids = [
            t.item() if isinstance(t, np.integer) else t for t in self.stop_token_ids or []
        ]
        if self.top_k == -1:
            self.top_k = 0

    def _validate_stops(self) -> None:
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ParameterError(
                "stop", f"stop has {len(self.stop)} strings; at most {MAX_STOP_STRINGS} are allowed"
            )
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ParameterError("stop", f"stop={self.stop!r:.200} must hold non-empty strings")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise ParameterError(
                    "stop",
                    f"a stop string of {len(s)} characters; at most {MAX_STOP_STRING_CHARS} "
                    f"are allowed",
                )
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ParameterError(
                "stop_token_ids",
                f"stop_token_ids has {len(self.stop_token_ids)} ids; at most "
                f"{MAX_STOP_TOKEN_IDS} are allowed",
            )
        for t in self.stop_token_ids:
            if not _is_int(t) or not 0 <= t <= INT32_MAX:
                raise ParameterError(
                    "stop_token_ids",
                    f"stop_token_ids={self.stop_token_ids!r:.200} must hold token ids in "
                    f"[0, 2**31)",
                )

    def _validate_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -MAX_PRESENCE_PENALTY <= v <= MAX_PRESENCE_PENALTY:
                raise ParameterError(name, f"{name}={v!r:.50} must be a number in [-2, 2]")
        r = self.repetition_penalty
        if not _is_number(r) or not MIN_REPETITION_PENALTY <= r <= MAX_REPETITION_PENALTY:
            raise ParameterError(
                "repetition_penalty",
                f"repetition_penalty={r!r:.50} must be a number in "
                f"[{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY:g}] (1: off)",
            )
        m = self.min_tokens
        if not _is_int(m) or not 0 <= m <= self.max_tokens:
            raise ParameterError(
                "min_tokens",
                f"min_tokens={m!r:.50} must be an integer in [0, max_tokens={self.max_tokens}]",
            )

    def _validate_logit_bias(self) -> None:
        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, dict):
            raise ParameterError(
                "logit_bias", f"logit_bias={bias!r:.200} must map token ids to numbers"
            )
        if len(bias) > MAX_LOGIT_BIAS:
            raise ParameterError(
                "logit_bias",
                f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS} are allowed",
            )
        for t, b in bias.items():
            if not _is_int(t) or not 0 <= t <= INT32_MAX:
                raise ParameterError("logit_bias", f"logit_bias key {t!r:.50} is not a token id")
            if not _is_number(b) or not -MAX_LOGIT_BIAS_VALUE <= b <= MAX_LOGIT_BIAS_VALUE:
                raise ParameterError(
                    "logit_bias",
                    f"logit_bias[{t}]={b!r:.50} must be a number in [-100, 100]",
                )

    def check_vocab(self, vocab_size: int) -> None:
        """The stop token ids and logit_bias keys are ids of the model's vocabulary
        (ParameterError otherwise)."""
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        if bad:
            raise ParameterError(
                "stop_token_ids",
                f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {vocab_size})",
            )
        bad = [t for t in self.logit_bias or () if t >= vocab_size]
        if bad:
            raise ParameterError(
                "logit_bias",
                f"logit_bias keys {bad[:5]} are outside the vocabulary [0, {vocab_size})",
            )


def _check_n(n: object) -> None:
    if not _is_int(n) or not 1 <= n <= MAX_N:
        raise ParameterError("n", f"n={n!r:.50} must be an integer in [1, {MAX_N}]")


def sample_choices(params: SamplingParams, n: int | None = None) -> list[SamplingParams]:
    """The settings of each of `n` (default `params.n`) samples of one prompt, one request each:
    n = 1, and sample j seeded with seed + j (modulo 2**31) where a seed is given, so a seeded
    prompt's samples differ from one another and each answers the same whatever runs beside it
    (without a seed each request draws its own). ParameterError for an n out of range (the
    other settings are the engine's to check, as for any request)."""
    n = params.n if n is None else n
    _check_n(n)  # a field set after construction was never checked
    if n == 1 and params.n == 1:
        return [params]
    return [
        dataclasses.replace(
            params, n=1, seed=None if params.seed is None else (params.seed + j) % (INT32_MAX + 1)
        )
        for j in range(n)
    ]
