"""Multi-step decode on the real model (`num_scheduler_steps`): one compiled program runs k decode
steps, each step's samples the next one's inputs. Its tokens equal one step per launch for greedy,
seeded random and filtered sampling, stop tokens included; nothing compiles after warm-up and no
page leaks. One engine per setting for the module (tiny float32 model, reference attention)."""

from __future__ import annotations

import numpy as np
import pytest
from engine_fixtures import small_llm

from nori_jax import SamplingParams

K = 4


@pytest.fixture(scope="module")
def one_step():
    return small_llm("tiny-llama", max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def multi_step():
    return small_llm(
        "tiny-llama", max_num_batched_tokens=32, num_scheduler_steps=K, multi_step_max_seqs=4
    )


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 250, int(rng.integers(2, 40))).tolist() for _ in range(n)]


def _settings(n: int) -> list[SamplingParams]:
    """Greedy, random and filtered (top-k / top-p, min-p) rows, a logit_bias, max_tokens that do
    and do not divide by K."""
    kinds = [
        dict(temperature=0.0),
        dict(temperature=1.0, seed=3, logprobs=0),
        dict(temperature=0.8, top_k=20, top_p=0.9, seed=11),
        dict(temperature=0.9, seed=7),
        dict(temperature=1.1, min_p=0.1, seed=5),
        dict(temperature=0.0, logit_bias={5: 3.0, 9: -100.0, 77: 1.5}),
    ]
    return [SamplingParams(max_tokens=9 + 5 * (i % 3), **kinds[i % len(kinds)]) for i in range(n)]


def _run(llm, prompts, params):
    outs = llm.generate(prompts, params)
    return [(o.token_ids, o.finish_reason) for o in outs], outs


def test_multi_step_programs_are_compiled_for_the_small_buckets_only(multi_step):
    names = set(multi_step.engine.runner.compiled_programs())
    assert {
        "multi-step bucket 16 greedy",
        "multi-step bucket 16 random",
        "multi-step bucket 16 filter-8",
    } <= names
    assert not any(n.startswith("multi-step bucket 32") for n in names)  # 4 rows fit bucket 16
    launches = multi_step.engine.runner.direct_launches()
    assert {n for n in launches if n.startswith("multi-step")} == {
        n for n in names if n.startswith("multi-step")
    }
    assert all(launches.values()), launches


@pytest.mark.parametrize("num_requests", [3, 7])
def test_tokens_equal_one_step_per_launch(one_step, multi_step, num_requests):
    """3 requests: every decode runs multi-step. 7 (above multi_step_max_seqs=4): the batch
    starts with plain steps and the tail runs multi-step."""
    prompts, params = _prompts(num_requests, seed=num_requests), _settings(num_requests)
    steps_before = multi_step.engine.core.step_times.steps
    expected, one_outs = _run(one_step, prompts, params)
    got, outs = _run(multi_step, prompts, params)
    assert got == expected
    for one, multi in zip(one_outs, outs, strict=True):  # every token's own logprob
        if one.logprobs is not None:
            assert len(multi.logprobs) == len(multi.token_ids)
            np.testing.assert_allclose(multi.logprobs, one.logprobs, rtol=1e-5, atol=1e-5)
    # Fewer launches than tokens per request: the decode steps ran several per launch.
    launches = multi_step.engine.core.step_times.steps - steps_before
    assert launches < max(len(t) for t, _ in got)
    assert multi_step.engine.num_recompiles == 0
    assert multi_step.engine.core.scheduler.allocator.num_used_pages == 0


def test_top_logprobs_run_one_step_a_launch(one_step, multi_step):
    """A request with top logprobs makes its steps single launches (the top-logprobs program
    follows a single step's forward pass), with one step's tokens and top logprobs; once it
    finishes, the others decode multi-step again."""
    prompts = _prompts(3, seed=5)
    params = [
        SamplingParams(max_tokens=6, temperature=0.9, seed=7, logprobs=3),
        SamplingParams(max_tokens=24, temperature=0.0),
        SamplingParams(max_tokens=24, temperature=0.0, logprobs=0),
    ]
    expected, one_outs = _run(one_step, prompts, params)
    core = multi_step.engine.core
    launches, multi = core.step_times.steps, core.step_times.multi_step_launches
    got, outs = _run(multi_step, prompts, params)
    assert got == expected
    for a, b in zip(outs[0].top_logprobs, one_outs[0].top_logprobs, strict=True):
        assert len(a) == 3 and [t for t, _ in a] == [t for t, _ in b]
        np.testing.assert_allclose([v for _, v in a], [v for _, v in b], atol=1e-5)
    multi = core.step_times.multi_step_launches - multi
    assert multi > 0  # after the request with top logprobs finished
    # its 6 tokens came from single launches: at least that many besides the multi-step ones
    assert core.step_times.steps - launches - multi >= 6
    assert multi_step.engine.num_recompiles == 0


def test_a_stop_token_inside_a_launch_ends_the_output_there(one_step, multi_step):
    prompt = _prompts(1, seed=21)[0]
    free, _ = _run(one_step, [prompt], [SamplingParams(max_tokens=16, temperature=0.0)])
    tokens = free[0][0]
    stop = tokens[5]
    params = SamplingParams(max_tokens=16, temperature=0.0, stop_token_ids=[stop])
    expected, _ = _run(one_step, [prompt], [params])
    got, _ = _run(multi_step, [prompt], [params])
    assert got == expected == [(tokens[: tokens.index(stop) + 1], "stop")]
    assert multi_step.engine.core.scheduler.allocator.num_used_pages == 0


def test_the_multi_step_program_updates_the_kv_pool_in_place(multi_step):
    """The pool is donated and carried through the scan: XLA aliases it to the output and the
    program's scratch stays below one copy of it (a copy would not fit beside a full pool)."""
    runner = multi_step.engine.runner
    pool = sum(x.nbytes for x in runner.kv_pages)
    for name, exe in runner.compiled_programs().items():
        if name.startswith("multi-step"):
            memory = exe.memory_analysis()
            assert memory.alias_size_in_bytes >= pool, name
            assert memory.temp_size_in_bytes < pool, name


def test_the_multi_step_buffers_keep_their_addresses(multi_step):
    """A multi-step launch writes its samples of every step into the runner's own buffer too
    (donated, returned in place), so its CUDA graph is never updated for a moved output; the
    host's copy is made by the next launch's staging program or by fetch."""
    runner = multi_step.engine.runner

    def addresses():
        states = [runner._step_state, runner._samples_state, runner._all_samples_state]
        return [x.unsafe_buffer_pointer() for x in states + list(runner.kv_pages)]

    assert runner._all_samples_state.shape == (K, 2, runner.layout.max_num_seqs)
    before = addresses()
    launches = multi_step.engine.core.step_times.multi_step_launches
    _run(multi_step, _prompts(3, seed=5), _settings(3))
    assert multi_step.engine.core.step_times.multi_step_launches > launches
    assert addresses() == before
    names = set(runner.compiled_programs())
    assert {"stage+peek multi-step", "peek multi-step"} <= names
