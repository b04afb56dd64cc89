"""`LLM.generate` as callers meet it: prompts as numpy or JAX arrays, more requests than the
waiting queue holds, a refusal or an interrupt in the middle of a batch, requests of another
caller in the same engine, and SamplingParams changed after construction. After every failure
nothing of the call stays queued and the next call gives the same tokens."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from engine_fixtures import small_llm

from nori_jax import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14], [15, 16]]


@pytest.fixture(scope="module")
def llm() -> LLM:
    # A waiting queue of two: most batches here are larger than it.
    return small_llm("tiny-llama", max_num_waiting=2)


@pytest.fixture(scope="module")
def alone(llm) -> list[list[int]]:
    """Each prompt's greedy tokens, generated on its own."""
    return [llm.generate([p], GREEDY)[0].token_ids for p in PROMPTS]


def _idle(llm: LLM) -> None:
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.scheduler.allocator.num_used_pages == 0


def test_a_batch_larger_than_the_waiting_queue_finishes_whole(llm, alone):
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == alone
    many = llm.generate([PROMPTS[0]], SamplingParams(n=5, max_tokens=3, seed=1))
    assert [o.index for o in many] == [0, 1, 2, 3, 4]
    _idle(llm)


def test_an_engine_refusal_mid_batch_leaves_nothing_queued(llm, alone):
    """Prompt 3's logit_bias names a token past the vocabulary: only the engine knows its size,
    so the refusal comes after prompts 0-2 were queued; they are aborted, not left behind."""
    params = [GREEDY] * 3 + [SamplingParams(max_tokens=4, logit_bias={10**6: 1.0})] + [GREEDY]
    with pytest.raises(ValueError, match="prompt 3: .*logit_bias"):
        llm.generate(PROMPTS, params)
    _idle(llm)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == alone


def test_an_interrupt_aborts_the_calls_requests(llm, alone, monkeypatch):
    step, calls = llm.engine.step, []

    def interrupted_step():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return step()

    with monkeypatch.context() as m:
        m.setattr(llm.engine, "step", interrupted_step)
        with pytest.raises(KeyboardInterrupt):
            llm.generate(PROMPTS, GREEDY)
    llm.engine.drain()  # the step in flight when it stopped (overlapped scheduling)
    _idle(llm)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == alone


def test_generate_waits_for_its_own_requests_only(llm, alone):
    engine = llm.engine
    engine.add_request("another-caller", [20, 21], SamplingParams(max_tokens=1))
    long = engine.add_request("long", [22, 23], SamplingParams(max_tokens=200, ignore_eos=True))
    assert [o.token_ids for o in llm.generate(PROMPTS[:2], GREEDY)] == alone[:2]
    engine.abort(long)
    engine.abort("another-caller")  # (finished already, or aborted now)
    engine.drain()
    _idle(llm)


def test_drawn_ids_pass_over_ids_a_caller_took(llm):
    engine = llm.engine
    taken = int(engine.new_request_id().removeprefix("req-")) + 1
    engine.add_request(f"req-{taken}", [20, 21], SamplingParams(max_tokens=50, ignore_eos=True))
    assert len(llm.generate(PROMPTS[:3], GREEDY)) == 3
    engine.abort(f"req-{taken}")
    engine.drain()
    _idle(llm)


def test_token_ids_as_numpy_or_jax_arrays(llm, alone):
    assert llm.generate(np.array(PROMPTS[0]), GREEDY)[0].token_ids == alone[0]
    assert llm.generate(jnp.asarray(PROMPTS[0]), GREEDY)[0].token_ids == alone[0]
    rows = np.array([PROMPTS[0], PROMPTS[2][:3]], np.int32)  # a prompt per row
    assert [o.prompt_token_ids for o in llm.generate(rows, GREEDY)] == rows.tolist()
    mixed = [np.array(PROMPTS[1]), "abc", PROMPTS[3]]
    assert [o.token_ids for o in llm.generate(mixed, GREEDY)][::2] == [alone[1], alone[3]]
    streamed = dict(llm.generate_stream(jnp.asarray(PROMPTS[0]), GREEDY))  # one prompt
    assert [o.token_ids for o in streamed.values()] == [alone[0]]


@pytest.mark.parametrize(
    "prompts, params, match",
    [
        (b"hello", GREEDY, "prompts is bytes"),
        (None, GREEDY, "prompts must be a prompt"),
        (np.array([[0.5, 1.0]]), GREEDY, "integer token ids"),
        (["a", "b"], (GREEDY, GREEDY), "params must be a SamplingParams"),
        (["a", "b"], [GREEDY, None], r"params\[1\] must be a SamplingParams"),
        (["a"], {"max_tokens": 4}, "params must be a SamplingParams .*got dict"),
    ],
)
def test_bad_calls_name_the_argument(llm, prompts, params, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(prompts, params)
    _idle(llm)


def test_settings_changed_after_construction_follow_the_same_rules(llm):
    """validate() brings a field set later to the form the constructor would: a stop string is
    one stop (not its characters), None lists are empty, top_k -1 is off, numpy numbers are
    numbers."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    params.stop, params.stop_token_ids, params.top_k = "no such text", None, -1
    params.temperature, params.max_tokens = np.float32(0.0), np.int64(8)
    out = llm.generate(["abc"], params)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 8
    assert params.stop == ["no such text"] and params.stop_token_ids == [] and params.top_k == 0
    assert type(params.max_tokens) is int and type(params.temperature) is float
    params.stop = 5
    with pytest.raises(ValueError, match="stop=5 must be a string or a list"):
        llm.generate(["abc"], params)
    _idle(llm)
