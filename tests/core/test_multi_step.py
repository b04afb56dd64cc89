"""Multi-step decode in the scheduler (`num_scheduler_steps`): a launch runs k decode steps when
every running request decodes and none waits; outputs are exactly those of one step per launch.
The fake device computes each row's first `decode_steps[i]` steps and fills the rest with a token
the host must drop; invariants are checked after every step."""

from __future__ import annotations

import numpy as np
import pytest
from fake_runner import (
    FakeDevice,
    FakeExecutor,
    expected_output,
    make_request,
    make_scheduler,
    run_to_completion,
    shared_prefix_requests,
)

from nori_jax.core.engine_core import EngineCore
from nori_jax.core.output_processor import OutputProcessor
from nori_jax.core.outputs import EngineCoreOutputs, FinishedRequest, RequestMetrics
from nori_jax.core.request import Request, RequestTimes
from nori_jax.dummy_tokenizer import byte_tokenizer
from nori_jax.sampling_params import SamplingParams


def _requests(n: int, seed: int, max_out: int = 40):
    rng = np.random.default_rng(seed)
    return [
        make_request(
            f"r{i}",
            rng.integers(3, 900, int(rng.integers(1, 60))).tolist(),
            int(rng.integers(1, max_out)),
        )
        for i in range(n)
    ]


class _Launches:
    """on_step hook: counts multi-step launches and checks when they may happen."""

    def __init__(self):
        self.multi = self.single = 0

    def __call__(self, s, plan):
        if plan.num_steps == 1:
            self.single += 1
            return
        self.multi += 1
        assert not s.num_waiting, "a multi-step launch while requests wait"
        assert plan.distribution.tolist() == [plan.num_rows] * 2, "prefill rows in it"
        assert plan.num_rows <= s.config.multi_step_max_seqs
        steps = plan.decode_steps[: plan.num_rows]
        assert (steps >= 1).all() and (steps <= plan.num_steps).all()


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("k", [2, 5])
def test_multi_step_tokens_equal_one_step_per_launch(k, overlap):
    reqs = _requests(24, seed=k)
    seen = _Launches()
    s = make_scheduler(num_pages=96, num_scheduler_steps=k)
    done = run_to_completion(s, reqs, on_step=seen, overlap=overlap)
    assert seen.multi > 0 and seen.single > 0
    for r in reqs:
        assert done[r.request_id].output_token_ids == expected_output(
            r.prompt_token_ids, r.params.max_tokens
        )
        assert done[r.request_id].finish_reason == "length"


def test_a_row_stops_at_max_tokens_inside_a_launch_without_a_page_past_it():
    """max_tokens 6 with k=4: the second launch computes 2 of its 4 steps for the row; the
    check_plan of run_to_completion asserts each computed step has its page."""
    seen = _Launches()
    s = make_scheduler(num_pages=17, num_scheduler_steps=4, page_size=16)
    prompt = list(range(3, 17))  # 14 tokens: the output crosses a page boundary
    done = run_to_completion(s, [make_request("a", prompt, 6)], on_step=seen)
    assert done["a"].output_token_ids == expected_output(prompt, 6)
    # The prompt's step samples the first token, a launch of 4 steps four more, and the last
    # token comes from a plain step (a launch whose rows all take one step would waste three).
    assert (seen.multi, seen.single) == (1, 2)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_stop_token_inside_a_launch_drops_the_samples_after_it(overlap):
    prompt = [7, 8, 9]
    full = expected_output(prompt, 30)
    stop = full[6]
    s = make_scheduler(num_scheduler_steps=4)
    done = run_to_completion(
        s, [make_request("a", prompt, 30, stop_token_ids=[stop])], overlap=overlap
    )
    assert done["a"].output_token_ids == full[: full.index(stop) + 1]
    assert done["a"].finish_reason == "stop"


def test_eos_inside_a_launch_ends_the_request_and_ignore_eos_runs_past_it():
    prompt = [11, 12, 13, 14]
    full = expected_output(prompt, 24)
    eos = full[5]
    reqs = []
    for rid, ignore in (("stops", False), ("ignores", True)):
        r = make_request(rid, prompt, 24, ignore_eos=ignore)
        r.eos_token_ids = (eos,)
        reqs.append(r)
    done = run_to_completion(make_scheduler(num_scheduler_steps=4), reqs, overlap=True)
    assert done["stops"].output_token_ids == full[: full.index(eos) + 1]
    assert done["ignores"].output_token_ids == full


def test_preemption_with_multi_step_launches_in_flight_keeps_outputs_exact():
    """A pool too small for everyone: multi-step launches fall back to one step when their pages
    do not fit, and requests preempted while a launch of theirs is in flight keep its tokens."""
    reqs = shared_prefix_requests(20, seed=3, max_own=40, max_tokens=(10, 60))
    seen = _Launches()
    s = make_scheduler(num_pages=20, max_model_len=128, kv_headroom=0.0, num_scheduler_steps=4)
    done = run_to_completion(s, reqs, on_step=seen, overlap=True)
    assert s.counters.num_preemptions > 0 and seen.multi > 0
    for r in reqs:
        assert done[r.request_id].output_token_ids == expected_output(
            r.prompt_token_ids, r.params.max_tokens
        )


def test_no_multi_step_above_its_row_limit():
    seen = _Launches()
    s = make_scheduler(num_pages=96, num_scheduler_steps=3, multi_step_max_seqs=2)
    run_to_completion(s, _requests(8, seed=9), on_step=seen)
    assert seen.multi > 0  # the tail, once two or fewer run


def test_engine_core_streams_every_token_and_logprob_of_a_launch_in_order():
    """Through EngineCore and the OutputProcessor: several tokens of one request per step output
    (listed once per token), each with its own logprob, equal to one step per launch."""

    def run(k: int):
        s = make_scheduler(num_scheduler_steps=k)
        lp = lambda n: -np.arange(1, n + 1, dtype=np.float32) / 8  # noqa: E731
        core = EngineCore(s, s._builder, FakeExecutor(FakeDevice(s), lp))
        proc = OutputProcessor(None)
        for rid, n in (("a", 13), ("b", 7)):
            prompt = [5, 6, 7] if rid == "a" else [9, 10]
            req = Request(rid, prompt, make_request(rid, prompt, n, logprobs=0).params, seed=0)
            from nori_jax.core.engine_core import EngineCoreRequest

            core.add_request(
                EngineCoreRequest(rid, prompt, req.params, 0, [], RequestTimes(0.0).arrival)
            )
            proc.add(rid, None, prompt, req.params, stream=True)
        streamed: dict[str, list] = {"a": [], "b": []}
        final = {}
        while core.has_unfinished() or core.has_in_flight:
            out = core.step() if core.has_unfinished() else core.drain()
            for o in proc.process(out)[0]:
                streamed[o.request_id] += list(zip(o.new_token_ids, o.new_logprobs, strict=True))
                if o.finished:
                    final[o.request_id] = (o.token_ids, o.logprobs, o.finish_reason)
        return streamed, final

    one, four = run(1), run(4)
    assert four == one
    assert [t for t, _ in one[0]["a"]] == expected_output([5, 6, 7], 13)


def _outputs(rows: list[tuple[str, int]], finished=()) -> EngineCoreOutputs:
    ids = [r for r, _ in rows]
    tokens = np.array([t for _, t in rows], np.int32)
    return EngineCoreOutputs(ids, tokens.tobytes(), b"", list(finished), [])


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_ends_the_output_at_its_token_when_a_step_brings_several(stream):
    """The output processor checks stop strings token by token: tokens after the one that
    completes the stop are dropped, as they are when each comes in a step of its own."""
    text = "ab STOP cd"
    params = SamplingParams(max_tokens=50, stop=["STOP"])
    results = {}
    for name, chunks in (("one per step", [[c] for c in text]), ("all at once", [list(text)])):
        proc = OutputProcessor(byte_tokenizer(300))
        proc.add("a", None, [1, 2], params, stream=stream)
        ended = {}
        for chunk in chunks:
            _, e = proc.process(_outputs([("a", ord(c)) for c in chunk]))
            ended |= e
            if e:
                break
        metrics = RequestMetrics(0, 0, 0, 0, 0, 0, 0)
        final = proc.finish(FinishedRequest("a", "abort", 2, len(text), metrics))
        results[name] = (ended, final.token_ids, final.text, final.finish_reason)
    assert results["all at once"] == results["one per step"]
    assert results["one per step"] == ({"a": "stop"}, [ord(c) for c in "ab STOP"], "ab ", "stop")
