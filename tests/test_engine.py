"""Engine behaviour: batch invariance, zero recompiles, sampling settings, finishing, bad input."""

from __future__ import annotations

import numpy as np
import pytest
from engine_fixtures import small_llm

from nori_jax import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(hf_checkpoints) -> LLM:
    return small_llm(str(hf_checkpoints["llama"]))


@pytest.fixture(scope="module")
def text_llm() -> LLM:
    """The tiny-llama preset: dummy weights with the byte-level tokenizer, for text features."""
    return small_llm("tiny-llama")


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 300, int(rng.integers(1, 60))).tolist() for _ in range(n)]


SEEDED = [
    SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=0.8, top_k=5, top_p=0.9, seed=8, ignore_eos=True),
]


def test_batch_invariance_across_neighbours_and_buckets(hf_checkpoints, llm):
    target = [11, 22, 33, 44, 55, 66, 77]
    alone = llm.generate([target], GREEDY)[0].token_ids
    crowded = llm.generate(_prompts(7, seed=5)[:3] + [target] + _prompts(4, seed=6), GREEDY)[
        3
    ].token_ids
    # 32 rows: the 16-token bucket computes logits for its 16 rows only (runner.logit_rows), the
    # larger ones for 32; the 8-row engine above, for all 8 rows in every bucket.
    other_buckets = small_llm(
        str(hf_checkpoints["llama"]), max_num_batched_tokens=256, max_num_seqs=32
    )
    in_big_bucket = other_buckets.generate(_prompts(5, seed=7) + [target], GREEDY)[-1].token_ids
    assert alone == crowded == in_big_bucket
    # random and filtering samplers too, in both engines' buckets, decoding beside others
    # (the target between other rows: a padding row's logits are its last token's)
    for params in SEEDED:
        alone = llm.generate([target], params)[0].token_ids
        crowded = other_buckets.generate(
            _prompts(2, seed=8) + [target] + _prompts(2, seed=9),
            [GREEDY] * 2 + [params] + [GREEDY] * 2,
        )[2].token_ids
        assert alone == crowded, params
    assert other_buckets.engine.num_recompiles == 0


def test_no_compiles_after_warmup_over_many_shapes_and_settings(llm):
    rng = np.random.default_rng(0)
    prompts = _prompts(30, seed=1)
    params = [
        SamplingParams(
            max_tokens=int(rng.integers(1, 30)),
            temperature=float(rng.choice([0.0, 0.7, 1.3])),
            top_p=float(rng.choice([1.0, 0.9, 0.5])),
            top_k=int(rng.choice([0, 1, 20])),
            seed=int(rng.integers(0, 1000)),
            ignore_eos=True,
            logprobs=int(rng.integers(0, 2)),
        )
        for _ in prompts
    ]
    outs = llm.generate(prompts, params)
    assert [len(o.token_ids) for o in outs] == [p.max_tokens for p in params]
    assert llm.engine.num_recompiles == 0
    assert llm.get_metrics()["nori:recompiles_total"] == 0
    # and every launch went to the executable directly (executor/direct_call.py)
    launches = llm.engine.runner.direct_launches()
    assert launches and all(launches.values()), launches


def test_the_step_buffers_keep_their_addresses(llm):
    """Every buffer the forward pass reads or writes stays where it was from step to step (the
    step buffer, samples, logits, KV pages: the runner's own, donated), which is what lets XLA
    launch its CUDA graph on a GPU without updating it."""
    runner = llm.engine.runner

    def addresses():
        states = [runner._step_state, runner._samples_state, runner._logits_state]
        return [x.unsafe_buffer_pointer() for x in states + list(runner.kv_pages)]

    before = addresses()
    params = [GREEDY, SamplingParams(max_tokens=12, temperature=0.9, top_k=4, seed=1)]
    llm.generate(_prompts(6, seed=3), params * 3)
    assert addresses() == before


def test_each_launch_copies_the_last_steps_samples(llm):
    """In an overlapped engine the host's copy of a step's samples is made by the next launch's
    staging program ("stage+peek"): a separate `peek` runs only where a fetch finds no launch
    after it (the last step of a generate call)."""
    runner = llm.engine.runner
    kinds = ("stage", "stage+peek", "peek")
    originals = {kind: runner._direct[kind, None] for kind in kinds}
    calls = dict.fromkeys(kinds, 0)

    def counted(kind):
        def call(args):
            calls[kind] += 1
            return originals[kind](args)

        return call

    for kind in kinds:
        runner._direct[kind, None] = counted(kind)
    try:
        llm.generate(_prompts(3, seed=4), [GREEDY, SEEDED[1], GREEDY])
    finally:
        for kind in kinds:
            runner._direct[kind, None] = originals[kind]
    assert calls["stage+peek"] >= 11  # 12 tokens: a launch per token, the first after prefill
    assert calls["stage"] + calls["peek"] <= 3, calls


def test_same_seed_same_output_whatever_the_batch(llm):
    p = SamplingParams(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    a = llm.generate([[5, 6, 7]], p)[0].token_ids
    b = llm.generate(_prompts(5, seed=2) + [[5, 6, 7]], [GREEDY] * 5 + [p])[-1].token_ids
    c = llm.generate(
        [[5, 6, 7]], SamplingParams(max_tokens=16, temperature=1.0, seed=99, ignore_eos=True)
    )
    assert a == b
    assert a != c[0].token_ids


def test_n_samples_of_a_prompt_are_seeded_requests_of_their_own(llm):
    """n = 3: each prompt's samples one after the other, sample j the tokens of the same prompt
    alone with seed + j; the prompt's full pages computed once (the others read them from the
    prefix cache); generate_stream yields the same samples under the prompt's index."""
    prompts = [list(range(40, 80)), list(range(90, 125))]  # 40 and 35 tokens: 2 full pages each
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=50, ignore_eos=True, n=3)
    before = llm.get_metrics()["nori:prefix_cache_hits_total"]
    outs = llm.generate(prompts, params)
    hits = llm.get_metrics()["nori:prefix_cache_hits_total"] - before
    assert [o.index for o in outs] == [0, 1, 2, 0, 1, 2]
    alone = [
        llm.generate([prompt], SamplingParams(max_tokens=10, seed=50 + j, ignore_eos=True))[0]
        for prompt in prompts
        for j in range(3)
    ]
    assert [o.token_ids for o in outs] == [o.token_ids for o in alone]
    assert len({tuple(o.token_ids) for o in outs[:3]}) > 1  # seeds apart, samples apart
    assert [o.prompt_token_ids for o in outs] == [prompts[0]] * 3 + [prompts[1]] * 3
    assert hits >= 2 * 2 * 16  # two later samples of each prompt read its two full pages
    streamed = sorted((i, o.index, o.token_ids) for i, o in llm.generate_stream(prompts, params))
    assert streamed == [(i, j, outs[3 * i + j].token_ids) for i in range(2) for j in range(3)]


def test_the_engine_itself_takes_one_sample_a_request(llm):
    with pytest.raises(ValueError, match="n=2: a request is one sample"):
        llm.engine.add_request(None, [5, 6, 7], SamplingParams(n=2))
    p = SamplingParams(max_tokens=4)
    p.n = 0  # set after construction: still refused, before anything is queued
    with pytest.raises(ValueError, match="n=0"):
        llm.generate([[5, 6], [7, 8]], p)
    with pytest.raises(ValueError, match="prompt 1: n=0"):
        list(llm.generate_stream([[5, 6], ([7, 8], p)], GREEDY))
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.scheduler.allocator.num_used_pages == 0


def test_top_k_one_tiny_top_p_and_min_p_one_equal_greedy(llm):
    prompt = [[9, 8, 7, 6]]
    greedy = llm.generate(prompt, GREEDY)[0].token_ids
    top1 = llm.generate(
        prompt, SamplingParams(max_tokens=12, temperature=2.0, top_k=1, seed=3, ignore_eos=True)
    )[0].token_ids
    top_p = llm.generate(
        prompt, SamplingParams(max_tokens=12, temperature=2.0, top_p=1e-6, seed=3, ignore_eos=True)
    )[0].token_ids
    # min_p = 1 keeps only the tokens as likely as the most likely one: the argmax.
    min_p = llm.generate(
        prompt, SamplingParams(max_tokens=12, temperature=2.0, min_p=1.0, seed=3, ignore_eos=True)
    )[0].token_ids
    free = llm.generate(
        prompt, SamplingParams(max_tokens=12, temperature=2.0, seed=3, ignore_eos=True)
    )[0].token_ids
    assert greedy == top1 == top_p == min_p
    assert free != greedy  # at temperature 2 the same seed strays without a filter


def test_logit_bias_steers_its_own_request_only(llm):
    prompts = _prompts(3, seed=5)
    plain = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    banned = plain[1][0]
    params = [
        GREEDY,
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logit_bias={banned: -100}),
        SamplingParams(
            max_tokens=8, temperature=0.9, seed=4, ignore_eos=True, logit_bias={77: 100}
        ),
    ]
    outs = llm.generate(prompts, params)
    assert outs[0].token_ids == plain[0]  # a neighbour without a bias is untouched
    assert banned not in outs[1].token_ids and outs[1].token_ids != plain[1]
    assert outs[2].token_ids == [77] * 8


def test_logprobs_are_log_probabilities_of_sampled_tokens(llm):
    out = llm.generate(
        [[3, 4, 5]], SamplingParams(max_tokens=8, temperature=0.0, logprobs=1, ignore_eos=True)
    )[0]
    assert len(out.logprobs) == 8
    assert all(lp <= 0.0 for lp in out.logprobs)
    from model_harness import PagedSequence, load

    logits = PagedSequence(load(llm.engine.model.source)).feed([3, 4, 5] + out.token_ids[:-1])[2:]
    ref = (
        logits
        - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
        - logits.max(-1, keepdims=True)
    )
    expected = ref[np.arange(8), out.token_ids]
    np.testing.assert_allclose(out.logprobs, expected, rtol=1e-4, atol=1e-4)
    # logprobs=1 also gives the most likely token: greedy's own, with the same logprob
    assert [[t for t, _ in top] for top in out.top_logprobs] == [[t] for t in out.token_ids]
    np.testing.assert_allclose([top[0][1] for top in out.top_logprobs], out.logprobs, atol=1e-6)


def test_top_logprobs_against_the_reference(llm):
    """logprobs=k: the k most likely tokens of every position with their logprobs, against a
    float32 reference of the same checkpoint, for a sampled request (the sampler program) beside
    greedy ones with and without logprobs, each its own k."""
    prompts = [[3, 4, 5], [9, 8, 7, 6], [40, 41], [11, 12, 13, 14, 15]]
    params = [
        SamplingParams(max_tokens=6, temperature=0.8, seed=3, logprobs=5, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=0.0, logprobs=20, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=0.0, logprobs=0, ignore_eos=True),
    ]
    outs = llm.generate(prompts, params)
    assert outs[2].top_logprobs is None and outs[3].top_logprobs is None
    assert outs[3].logprobs is not None
    from model_harness import PagedSequence, load

    for prompt, p, out in zip(prompts[:2], params[:2], outs[:2], strict=True):
        n = len(prompt)
        logits = PagedSequence(load(llm.engine.model.source)).feed(prompt + out.token_ids[:-1])
        logits = logits[n - 1 :].astype(np.float64)
        ref = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        assert len(out.top_logprobs) == 6
        for j, top in enumerate(out.top_logprobs):
            assert len(top) == p.logprobs
            ids = [t for t, _ in top]
            np.testing.assert_allclose([v for _, v in top], ref[j, ids], atol=1e-4)
            assert sorted(ref[j, ids], reverse=True) == list(ref[j, ids])  # best first
            assert ref[j, ids[-1]] >= np.sort(ref[j])[-p.logprobs] - 1e-4  # none better left out
        # the sampled token's logprob is its entry where it is among the top
        for t, lp, top in zip(out.token_ids, out.logprobs, out.top_logprobs, strict=True):
            assert dict(top).get(t, lp) == pytest.approx(lp, abs=1e-6)
    assert llm.engine.num_recompiles == 0  # the top-logprobs programs were compiled and warmed


def test_stop_token_ids_and_eos(llm):
    greedy = llm.generate([[1, 2, 3]], GREEDY)[0].token_ids
    stop_at = greedy[4]
    out = llm.generate(
        [[1, 2, 3]],
        SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop_at], ignore_eos=True),
    )[0]
    assert out.token_ids == greedy[: greedy.index(stop_at) + 1]
    assert out.finish_reason == "stop"


def test_stop_strings_cut_text(text_llm):
    full = text_llm.generate(
        ["hello"], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    )[0]
    assert len(full.text) > 6
    stop = full.text[3:6]
    out = text_llm.generate(
        ["hello"], SamplingParams(max_tokens=20, temperature=0.0, stop=[stop], ignore_eos=True)
    )[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[: full.text.index(stop)]
    kept = text_llm.generate(
        ["hello"],
        SamplingParams(
            max_tokens=20,
            temperature=0.0,
            stop=[stop],
            include_stop_str_in_output=True,
            ignore_eos=True,
        ),
    )[0]
    assert kept.text == full.text[: full.text.index(stop) + len(stop)]


def test_max_model_len_finishes_with_length(hf_checkpoints):
    llm = small_llm(str(hf_checkpoints["llama"]), max_model_len=40)
    out = llm.generate(
        [list(range(3, 33))], SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    )[0]
    assert len(out.token_ids) == 10 and out.finish_reason == "length"


def test_outputs_in_input_order_text_and_ids(text_llm):
    outs = text_llm.generate(["abc", [104, 105], "a longer prompt here"], GREEDY)
    assert [o.prompt_token_ids for o in outs] == [
        [97, 98, 99],
        [104, 105],
        text_llm.tokenizer.encode("a longer prompt here"),
    ]
    assert outs[0].prompt == "abc" and outs[1].prompt is None


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ("", SamplingParams(), "prompt is empty"),
        ([], SamplingParams(), "prompt is empty"),
        ([5] * 300, SamplingParams(), "max_model_len=256"),
        ([5, 100000], SamplingParams(), "outside the vocabulary"),
        ("ab\ud800", SamplingParams(), "lone surrogate '\\\\ud800' at character 2"),
    ],
)
def test_bad_prompts_raise_value_error(text_llm, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        text_llm.generate([prompt], params)
    assert not text_llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_tokens=0), "max_tokens=0"),
        (dict(top_p=0.0), "top_p=0.0"),
        (dict(top_p=1.5), "top_p=1.5"),
        (dict(temperature=-1.0), "temperature=-1.0"),
        (dict(top_k=-5), "top_k=-5"),
        (dict(min_p=-0.1), "min_p=-0.1"),
        (dict(min_p=1.5), "min_p=1.5"),
        (dict(min_p=float("nan")), "min_p=nan"),
        (dict(min_p="0.1"), "min_p='0.1'"),
        (dict(logit_bias={5: 101}), r"logit_bias\[5\]=101"),
        (dict(logit_bias={-1: 1.0}), "logit_bias key -1"),
        (dict(logit_bias={i: 1.0 for i in range(257)}), "257 entries"),
        (dict(logit_bias=[1, 2]), "logit_bias"),
        (dict(n=0), "n=0"),
        (dict(n=4097), "n=4097"),
        (dict(n=True), "n=True"),
        (dict(n="2"), "n='2'"),
    ],
)
def test_bad_sampling_params_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_unknown_model_raises_value_error():
    with pytest.raises(ValueError, match="no-such-model"):
        LLM("no-such-model")
    with pytest.raises(ValueError, match="preset"):
        LLM("llama3.2-1b")  # a preset without load_format="dummy"


def test_a_bad_prompt_in_a_batch_queues_nothing(text_llm):
    with pytest.raises(ValueError, match="max_model_len=256"):
        text_llm.generate([[5, 6], "fine", [5] * 300], GREEDY)
    assert not text_llm.engine.has_unfinished_requests()
    assert text_llm.engine.scheduler.allocator.num_used_pages == 0


def test_a_priority_needs_the_priority_policy_and_queues_nothing(text_llm):
    """The default policy is FCFS: a priority other than 0 would be ignored, so it is refused
    (naming the field) before anything is queued; a list of the wrong length too."""
    with pytest.raises(ValueError, match="scheduling_policy='priority'"):
        text_llm.generate([[5, 6], [7, 8]], GREEDY, priority=[0, 2])
    with pytest.raises(ValueError, match="2 priorities for 3 prompts"):
        text_llm.generate([[5, 6], [7, 8], [9]], GREEDY, priority=[0, 0])
    assert not text_llm.engine.has_unfinished_requests()
    assert [o.token_ids for o in text_llm.generate([[5, 6]], GREEDY, priority=0)] == [
        text_llm.generate([[5, 6]], GREEDY)[0].token_ids
    ]


def test_priorities_under_the_priority_policy_keep_tokens_exact():
    llm = small_llm("tiny-llama", scheduling_policy="priority", max_num_seqs=2)
    prompts = _prompts(6, seed=12)
    plain = llm.generate(prompts, GREEDY)
    ranked = llm.generate(prompts, GREEDY, priority=[3, -1, 0, 2**31 - 1, -(2**31), 1])
    assert [o.token_ids for o in ranked] == [o.token_ids for o in plain]
    assert llm.engine.num_recompiles == 0
