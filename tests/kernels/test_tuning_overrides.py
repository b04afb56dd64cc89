"""attention_tuning: TuningConfig fields written "[tokens<N:] field=value,...; ..." and set over
the schedule a kernel call would run. Parsed to exact clauses, refused by name where malformed,
and in the kernel call the same program as naming the changed schedule outright (lowered on CPU,
in interpret mode: the text of the program, not a run)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import pytest
from kernel_cases import make_step

from pallas_kernels.ragged_paged_attention.pallas_attention import (
    bucket_tuning,
    ragged_paged_attention_pallas,
)
from pallas_kernels.ragged_paged_attention.tuning import TuningConfig
from pallas_kernels.ragged_paged_attention.tuning_overrides import (
    OverrideClause,
    fields_for,
    format_overrides,
    parse_tuning_overrides,
    with_overrides,
)


def test_fields_keep_their_order_and_take_each_fields_kind():
    (clause,) = parse_tuning_overrides(" prefill_interleave=per_step, pingpong=On,num_stages=3 ")
    assert clause == OverrideClause(
        (("prefill_interleave", "per_step"), ("pingpong", True), ("num_stages", 3))
    )
    assert parse_tuning_overrides("prefill_interleave=false,fp8_qk=yes") == (
        OverrideClause((("prefill_interleave", False), ("fp8_qk", True))),
    )
    tuned = with_overrides(TuningConfig(), (clause,), num_tokens=16)
    assert (tuned.prefill_interleave, tuned.pingpong, tuned.num_stages) == ("per_step", True, 3)
    assert with_overrides(TuningConfig(), (), num_tokens=16) == TuningConfig()


def test_selectors_pick_buckets_by_token_count_and_later_clauses_win():
    text = "num_stages=4; tokens<2048: prefill_interleave=per_step,num_stages=3; tokens>=8192: "
    text += "mma_row_sums=false,num_stages=2"
    overrides = parse_tuning_overrides(text)
    assert [(c.min_tokens, c.max_tokens) for c in overrides] == [(0, None), (0, 2048), (8192, None)]
    assert fields_for(overrides, 2047) == {"num_stages": 3, "prefill_interleave": "per_step"}
    assert fields_for(overrides, 2048) == {"num_stages": 4}
    assert fields_for(overrides, 8192) == {"num_stages": 2, "mma_row_sums": False}
    assert parse_tuning_overrides(format_overrides(overrides)) == overrides
    assert fields_for(parse_tuning_overrides("tokens >= 16 : pingpong=true"), 15) == {}


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "must be '\\[tokens<N:\\] field=value,...; ...'"),
        ("pingpong", "item 'pingpong' must be field=value"),
        ("pingpong=", "item 'pingpong=' must be field=value"),
        ("stages=3", "'stages' is not a TuningConfig field"),
        ("pingpong=1", "pingpong='1' must be true or false"),
        ("num_stages=three", "num_stages='three' must be an integer"),
        ("block_kv=true", "block_kv='true' must be an integer"),
        ("block_kv=100", "block_kv=100: .* must be a multiple of 64"),
        ("producer_warps=2", "producer_warps=2: .* must be 1 or 4"),
        ("num_stages=17", "num_stages=17: .* must be in \\[2, 16\\]"),
        ("decode_splits=99999999999", "decode_splits=99999999999: .* must be in \\[1, 64\\]"),
        ("prefill_interleave=sometimes", r"must be a bool or 'per_step'"),
        ("num_stages=3,num_stages=4", "'num_stages' is given twice in one clause"),
        ("tokens<=2048: pingpong=true", "selector 'tokens<=2048' must be tokens<N or tokens>=N"),
        ("seqs<8: pingpong=true", "selector 'seqs<8' must be"),
        ("tokens<2048:", "item '' must be field=value"),
    ],
)
def test_malformed_overrides_are_refused_by_name(text, message):
    with pytest.raises(ValueError, match=message):
        parse_tuning_overrides(text)


STEP = make_step(3, decode_kv_lens=[20], prefill=[(24, 40)], page_size=16, num_q_heads=4,
                 num_kv_heads=2, head_dim=32, dtype=jnp.float32)  # fmt: skip
KW = dict(sm_scale=32**-0.5, interpret=True)


def _program(**kw) -> str:
    return ragged_paged_attention_pallas.lower(*STEP.args, **KW, **kw).as_text()


def test_an_override_is_the_program_of_the_schedule_it_names():
    q, pages, _, table = STEP.args[:4]
    base = bucket_tuning(q, pages, table, interpret=True)
    assert base.prefill_interleave is not False  # so the override below changes the program
    overridden = _program(tuning_overrides=parse_tuning_overrides("prefill_interleave=false"))
    assert overridden == _program(tuning=dataclasses.replace(base, prefill_interleave=False))
    assert overridden != _program()
    # a clause for other buckets leaves this one (28 tokens) as it was
    elsewhere = parse_tuning_overrides("tokens>=29: prefill_interleave=false")
    assert _program(tuning_overrides=elsewhere) == _program()


def test_a_combination_the_bucket_cannot_take_names_the_bucket():
    with pytest.raises(ValueError, match=r"attention_tuning 'prefill_kv_splits=2' does not fit "
                       r"the bucket of 28 tokens x 3 sequences x 4 pages of 16 \(q 4 heads, kv 2 "
                       r"heads of 32, float32 pages\): prefill_interleave"):  # fmt: skip
        _program(tuning_overrides=parse_tuning_overrides("prefill_kv_splits=2"))
