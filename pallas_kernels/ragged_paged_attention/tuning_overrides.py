"""Overrides of the attention kernel's schedule: TuningConfig fields set over the schedule each
call would run (default_tuning of its bucket), so a schedule can be tried on a whole engine
(EngineConfig.attention_tuning) without editing the tuning table.

Written as clauses separated by ";", each "field=value,field=value", optionally after a bucket
selector, "tokens<N:" or "tokens>=N:" (the bucket's token count; the table itself tells prefill
buckets, 2,048 tokens and more, from the rest):

    prefill_interleave=per_step
    tokens<2048: prefill_interleave=per_step; tokens>=2048: mma_row_sums=false

A count is an int, a flag true/false (or on/off, yes/no), prefill_interleave also per_step.
Where clauses select the same bucket the later one wins. The parsed form is hashable, so it can
be a static argument of the jitted kernel call. A value no schedule takes (block_kv=100) fails
here; a combination a bucket's schedule cannot take (prefill_interleave=true beside its
ping-pong) fails where that bucket is compiled, naming the bucket (pallas_attention.py).
"""

from __future__ import annotations

import dataclasses
import re

from pallas_kernels.ragged_paged_attention.tuning import TuningConfig

Value = bool | int | str
_TRUE = ("true", "on", "yes")
_FALSE = ("false", "off", "no")
_SELECTOR = re.compile(r"tokens\s*(<|>=)\s*(\d+)")


@dataclasses.dataclass(frozen=True)
class OverrideClause:
    """Fields set in the buckets of min_tokens <= num_tokens < max_tokens (None: no bound)."""

    fields: tuple[tuple[str, Value], ...]
    min_tokens: int = 0
    max_tokens: int | None = None

    def applies(self, num_tokens: int) -> bool:
        return self.min_tokens <= num_tokens and (
            self.max_tokens is None or num_tokens < self.max_tokens
        )

    def __str__(self) -> str:
        fields = ",".join(f"{k}={str(v).lower()}" for k, v in self.fields)
        if self.max_tokens is not None:
            return f"tokens<{self.max_tokens}: {fields}"
        return f"tokens>={self.min_tokens}: {fields}" if self.min_tokens else fields


TuningOverrides = tuple[OverrideClause, ...]


def parse_tuning_overrides(text: str) -> TuningOverrides:
    """The clauses of `text`, in the order written; ValueError naming a selector that is not
    tokens<N / tokens>=N, an item that is not field=value, a field TuningConfig lacks, a field
    given twice in a clause, or a value the field cannot take."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"attention_tuning={text!r} must be '[tokens<N:] field=value,...; ...'")
    return tuple(_clause(part) for part in text.split(";") if part.strip())


def _clause(text: str) -> OverrideClause:
    selector, colon, body = text.partition(":")
    bounds: dict[str, int] = {}
    if not colon:
        body = selector
    else:
        match = _SELECTOR.fullmatch(selector.strip())
        if match is None:
            raise ValueError(
                f"attention_tuning selector {selector.strip()!r} must be tokens<N or tokens>=N"
            )
        op, n = match.group(1), int(match.group(2))
        bounds = {"max_tokens": n} if op == "<" else {"min_tokens": n}
    kinds = {f.name: str(f.type) for f in dataclasses.fields(TuningConfig)}
    fields: dict[str, Value] = {}
    for item in body.split(","):
        name, sep, raw = (part.strip() for part in item.partition("="))
        if not (sep and name and raw):
            raise ValueError(f"attention_tuning item {item.strip()!r} must be field=value")
        if name not in kinds:
            raise ValueError(
                f"attention_tuning field {name!r} is not a TuningConfig field ({', '.join(kinds)})"
            )
        if name in fields:
            raise ValueError(f"attention_tuning field {name!r} is given twice in one clause")
        value = _value(name, kinds[name], raw)
        try:  # a value no schedule takes fails now, not when the first bucket compiles
            dataclasses.replace(TuningConfig(), **{name: value})
        except ValueError as e:
            raise ValueError(f"attention_tuning {name}={raw}: {e}") from None
        fields[name] = value
    return OverrideClause(tuple(fields.items()), **bounds)


def _value(name: str, kind: str, raw: str) -> Value:
    word = raw.lower()
    if "bool" in kind and word in _TRUE + _FALSE:
        return word in _TRUE
    if kind == "int":
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"attention_tuning {name}={raw!r} must be an integer") from None
    if "str" in kind:
        return word  # prefill_interleave's per_step; TuningConfig names what else it takes
    raise ValueError(f"attention_tuning {name}={raw!r} must be true or false")


def format_overrides(overrides: TuningOverrides) -> str:
    """The overrides as parse_tuning_overrides reads them."""
    return "; ".join(str(clause) for clause in overrides)


def fields_for(overrides: TuningOverrides, num_tokens: int) -> dict[str, Value]:
    """The fields set in a bucket of `num_tokens` tokens (later clauses win)."""
    fields: dict[str, Value] = {}
    for clause in overrides:
        if clause.applies(num_tokens):
            fields.update(clause.fields)
    return fields


def with_overrides(tuning: TuningConfig, overrides: TuningOverrides, num_tokens: int):
    """`tuning` with the fields the overrides set in this bucket (validated by TuningConfig:
    ValueError)."""
    fields = fields_for(overrides, num_tokens)
    return dataclasses.replace(tuning, **fields) if fields else tuning
