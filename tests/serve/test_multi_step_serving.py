"""Multi-step decode behind the server (`--num-scheduler-steps`), the engine core in its own
process: a step's output brings several tokens of a request across the socket. Streams, stop
strings and logprobs give what one step per launch gives (the in-process engine)."""

from __future__ import annotations

import pytest
from openai import OpenAI
from serve_harness import MODEL_NAME, Server, client, engine_config, running_server

from nori_jax import LLM, SamplingParams
from nori_jax.core_client import EngineCoreClient

K = 4
PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3,"]


@pytest.fixture(scope="module")
def server():
    config = engine_config(num_scheduler_steps=K, multi_step_max_seqs=8)
    with running_server(engine=EngineCoreClient(config)) as s:
        yield s


@pytest.fixture(scope="module")
def one_step() -> LLM:
    return LLM.from_config(engine_config())


@pytest.fixture(scope="module")
def oai(server: Server) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def test_streamed_and_whole_outputs_equal_one_step_per_launch(server, one_step, oai) -> None:
    params = SamplingParams(max_tokens=13, temperature=0.0, ignore_eos=True)
    expected = [o.text for o in one_step.generate(PROMPTS, params)]
    extra = {"ignore_eos": True}
    for prompt, want in zip(PROMPTS, expected, strict=True):
        kw = dict(model=MODEL_NAME, prompt=prompt, max_tokens=13, temperature=0.0)
        whole = oai.completions.create(**kw, extra_body=extra)
        chunks = list(oai.completions.create(**kw, extra_body=extra, stream=True))
        assert whole.choices[0].text == want
        assert "".join(c.choices[0].text for c in chunks) == want
        assert whole.usage.completion_tokens == 13
    with client(server) as c:
        metrics = c.get("/metrics").text
    assert "nori:recompiles_total 0.0" in metrics


def test_a_stop_string_inside_a_launch_cuts_as_one_step_does(one_step, oai) -> None:
    prompt = PROMPTS[0]
    free = one_step.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0))[0].text
    stop = free[6:8]  # two characters from inside the output: several tokens in
    params = SamplingParams(max_tokens=16, temperature=0.0, stop=[stop])
    want = one_step.generate([prompt], params)[0]
    got = oai.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=16, temperature=0.0, stop=[stop]
    )
    assert (got.choices[0].text, got.choices[0].finish_reason) == (want.text, "stop")
    assert got.usage.completion_tokens == len(want.token_ids)


def test_every_token_of_a_launch_has_its_own_logprob(one_step, oai) -> None:
    prompt = PROMPTS[1]
    want = one_step.generate(
        [prompt], SamplingParams(max_tokens=11, temperature=0.7, seed=5, logprobs=0)
    )[0]
    got = oai.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=11, temperature=0.7, seed=5, logprobs=0
    )
    lp = got.choices[0].logprobs.token_logprobs
    assert got.choices[0].text == want.text and len(lp) == len(want.logprobs)
    assert lp == pytest.approx(want.logprobs, abs=1e-4)
