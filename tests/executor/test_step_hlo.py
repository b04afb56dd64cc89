"""No host synchronization in the step: the compiled programs branch on no device data.

A multi-step program's decode steps are a `scan` of static length: a `while` whose trip count
XLA knows (`known_trip_count`), which runs without asking the host.

On XLA:GPU a `conditional`, or a `while` whose trip count XLA cannot know, copies its predicate to
the host and blocks. Every program the engine runs (each bucket's forward pass, each sampler mode)
may hold neither, except inside the attention (named scope `paged_attention`), whose reference
form loops over pages by design and whose kernel loops inside its own body.
"""

from __future__ import annotations

import re

import pytest
from tiny_multi_step import TINY_MULTI_STEP

from nori_jax import LLM
from nori_jax.models.llama import ATTENTION_SCOPE

_CONTROL = re.compile(r"=\s.*?\b(conditional|while)\(")


@pytest.fixture(scope="module", params=[False, True], ids=["default", "stack_weights"])
def programs(request):
    llm = LLM("tiny-llama", stack_weights=request.param, **TINY_MULTI_STEP)
    return {name: exe.as_text() for name, exe in llm.engine.runner.compiled_programs().items()}


def control_flow(hlo: str) -> list[tuple[str, str]]:
    """(opcode, instruction line) of every conditional and while in a compiled HLO module."""
    return [(m.group(1), line) for line in hlo.splitlines() if (m := _CONTROL.search(line))]


def test_every_bucket_and_sampler_mode_is_checked(programs):
    assert {"bucket 16", "bucket 32"} <= set(programs)
    # greedy sampling is part of every forward pass; its own program samples penalized logits
    assert {"sampler random (8 rows)", "sampler filter-8 (8 rows)"} <= set(programs)
    assert {"sampler greedy (8 rows)", "penalties (8 rows)", "penalty counts"} <= set(programs)
    assert {"multi-step bucket 16 greedy", "multi-step bucket 16 filter-8"} <= set(programs)
    assert {"top logprobs (8 rows)"} <= set(programs)  # the top-k of the rows that ask
    assert {f"prompt logprobs top {k} (8 rows)" for k in (0, 1, 20)} <= set(programs)


def test_no_data_dependent_control_flow_outside_the_attention(programs):
    for name, hlo in programs.items():
        for opcode, line in control_flow(hlo):
            if f"/{ATTENTION_SCOPE}/" in line:
                continue
            assert opcode == "while" and '"known_trip_count"' in line, (
                f"{name}: {opcode} outside the attention would block on the device: {line[:300]}"
            )


def test_the_check_sees_a_conditional():
    """The parser finds what it must reject (a module with a lax.cond)."""
    import jax
    import jax.numpy as jnp

    f = jax.jit(lambda x: jax.lax.cond(x.sum() > 0, lambda y: y + 1, lambda y: y - 1, x))
    hlo = f.lower(jnp.ones(4)).compile().as_text()
    assert [op for op, _ in control_flow(hlo)] == ["conditional"]


def test_the_norm_scales_arrive_as_one_stacked_argument(programs):
    # tiny-llama: 2 layers, hidden 64: 5 RMSNorm scales of f32[64] (param_packing.py)
    entry = programs["bucket 16"].split("ENTRY", 1)[1]
    params = re.findall(r"= (\w+\[[\d,]*\])\{?[\d,]*\}? parameter\(", entry)
    assert "f32[5,64]" in params
    assert "f32[64]" not in params
