"""The routes as clients see them: the official openai client, httpx for /generate, /metrics."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import httpx
import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_harness import CHAT_TEMPLATE, MODEL_NAME, Server, client, running_server

from nori_jax import SamplingParams


@pytest.fixture(scope="module")
def server():
    with running_server() as s:
        yield s


@pytest.fixture(scope="module")
def oai(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


def generate(server: Server, prompt: str | list[int], max_tokens: int, **extra) -> dict:
    with client(server) as c:
        r = c.post(
            "/generate",
            json={
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
            }
            | extra,
        )
    assert r.status_code == 200, r.text
    return r.json()


def test_health_and_models(server: Server, oai: openai.OpenAI) -> None:
    with client(server) as c:
        assert c.get("/health").json() == {"status": "ok"}
    models = oai.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert models.data[0].model_extra["max_model_len"] == 256


def test_completion(server: Server, oai: openai.OpenAI) -> None:
    resp = oai.completions.create(
        model=MODEL_NAME, prompt="The capital of France is", max_tokens=12, **GREEDY
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "length"
    assert resp.usage.prompt_tokens == len("The capital of France is")  # one token per byte
    assert resp.usage.completion_tokens == 12
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 12
    # The same greedy request through /generate gives the same text.
    assert choice.text == generate(server, "The capital of France is", 12)["text"]
    timings = resp.model_extra["metrics"]
    for stage in (
        "queue_time",
        "prefill_time",
        "decode_time",
        "time_to_first_token",
        "e2e_latency",
    ):
        assert timings[stage] >= 0.0
    assert timings["e2e_latency"] >= timings["queue_time"] + timings["prefill_time"]


def test_completion_stream_matches_whole(server: Server, oai: openai.OpenAI) -> None:
    whole = oai.completions.create(model=MODEL_NAME, prompt="stream me", max_tokens=10, **GREEDY)
    chunks = list(
        oai.completions.create(
            model=MODEL_NAME,
            prompt="stream me",
            max_tokens=10,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_token_ids_and_logprobs(server: Server, oai: openai.OpenAI) -> None:
    ids = [72, 101, 108, 108, 111]  # "Hello" in the byte-level vocabulary
    resp = oai.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=6, logprobs=1, **GREEDY)
    assert resp.usage.prompt_tokens == 5
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 6
    assert all(x <= 0.0 for x in lp.token_logprobs)
    assert resp.choices[0].text == generate(server, "Hello", 6)["text"]


def test_top_logprobs_through_the_official_client(oai: openai.OpenAI) -> None:
    """Chat's logprobs + top_logprobs and the completions route's logprobs = k, whole and
    streamed: k most likely tokens per position, best first; greedy's token is the first."""
    chat = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi!"}], max_tokens=5)
    whole = oai.chat.completions.create(**chat, logprobs=True, top_logprobs=4, **GREEDY)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens == 5
    for entry in content:
        tops = entry.top_logprobs
        assert len(tops) == 4
        assert [t.logprob for t in tops] == sorted((t.logprob for t in tops), reverse=True)
        assert (tops[0].token, tops[0].logprob) == (entry.token, entry.logprob)
        assert all(t.bytes == list(t.token.encode()) for t in tops)
    stream = oai.chat.completions.create(
        **chat, logprobs=True, top_logprobs=4, stream=True, **GREEDY
    )
    streamed = [
        e
        for c in stream
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    # the same tokens and logprobs (to float32 noise: the second run's prompt hits the prefix
    # cache, whose attention sums in another order)
    assert [[t.token for t in e.top_logprobs] for e in streamed] == [
        [t.token for t in e.top_logprobs] for e in content
    ]
    np.testing.assert_allclose(
        [[t.logprob for t in e.top_logprobs] for e in streamed],
        [[t.logprob for t in e.top_logprobs] for e in content],
        atol=1e-5,
    )
    # logprobs without top_logprobs: empty lists, as OpenAI answers
    plain = oai.chat.completions.create(**chat, logprobs=True, **GREEDY)
    assert all(e.top_logprobs == [] for e in plain.choices[0].logprobs.content)

    resp = oai.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=5, logprobs=3, **GREEDY)
    lp = resp.choices[0].logprobs
    assert len(lp.top_logprobs) == len(lp.tokens) == 5
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 1 <= len(top) <= 4 and top[token] == logprob  # the top 3, and the sampled token
        assert max(top.values()) == logprob  # greedy


def test_stop_string(server: Server, oai: openai.OpenAI) -> None:
    full = generate(server, "stop test", 40)["text"]
    stop = full[10:14]  # greedy, so the same text comes again and holds this string
    cut = full[: full.index(stop)]
    resp = oai.completions.create(
        model=MODEL_NAME, prompt="stop test", max_tokens=40, stop=[stop], **GREEDY
    )
    assert resp.choices[0].text == cut
    assert resp.choices[0].finish_reason == "stop"
    streamed = oai.completions.create(
        model=MODEL_NAME, prompt="stop test", max_tokens=40, stop=stop, stream=True, **GREEDY
    )
    assert "".join(c.choices[0].text for c in streamed) == cut


def test_seed_makes_sampling_reproducible(oai: openai.OpenAI) -> None:
    def sample() -> str:
        return (
            oai.completions.create(
                model=MODEL_NAME,
                prompt="dice",
                max_tokens=12,
                temperature=1.0,
                seed=1234,
                extra_body={"top_k": 50},
            )
            .choices[0]
            .text
        )

    assert sample() == sample()


def test_min_p_one_is_greedy_through_the_server(oai: openai.OpenAI) -> None:
    """vLLM's min_p extension: 1.0 keeps only the most likely token, so a hot sampler with it
    writes the greedy answer, on both routes."""
    hot = {"temperature": 2.0, "seed": 5}

    def text(**extra) -> str:
        return (
            oai.completions.create(model=MODEL_NAME, prompt="dice", max_tokens=12, **extra)
            .choices[0]
            .text
        )

    greedy = text(**GREEDY)
    assert text(**hot, extra_body={"ignore_eos": True, "min_p": 1.0}) == greedy
    assert text(**hot, extra_body={"ignore_eos": True}) != greedy
    chat = [{"role": "user", "content": "Hi!"}]
    answers = [
        oai.chat.completions.create(model=MODEL_NAME, messages=chat, max_tokens=8, **kw)
        .choices[0]
        .message.content
        for kw in (GREEDY, dict(hot, extra_body={"ignore_eos": True, "min_p": 1.0}))
    ]
    assert answers[0] == answers[1]


def test_logit_bias_through_the_official_client(oai: openai.OpenAI) -> None:
    """OpenAI's logit_bias (token id strings -> [-100, 100]): +100 on one token makes a hot
    sampler and greedy write only it, on both routes."""
    hot = oai.completions.create(
        model=MODEL_NAME,
        prompt="dice",
        max_tokens=6,
        temperature=1.5,
        seed=2,
        logit_bias={"77": 100},
        logprobs=1,
        extra_body={"ignore_eos": True},
    )
    choice = hot.choices[0]
    assert len(choice.logprobs.tokens) == 6
    # logprobs are of the distribution sampled from: with +100 the token is certain
    assert all(-1e-3 < lp <= 0.0 for lp in choice.logprobs.token_logprobs)
    ids = oai.completions.create(
        model=MODEL_NAME, prompt=[5, 6, 7], max_tokens=4, logit_bias={"77": 100}, **GREEDY
    )
    greedy = oai.completions.create(model=MODEL_NAME, prompt=[5, 6, 7], max_tokens=4, **GREEDY)
    assert ids.choices[0].text != greedy.choices[0].text
    chat = oai.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Hi!"}],
        max_tokens=4,
        logit_bias={"77": 100},
        **GREEDY,
    )
    assert chat.choices[0].message.content == ids.choices[0].text


def test_choices_with_more_bias_entries_than_a_step_holds_all_finish(
    oai: openai.OpenAI,
) -> None:
    """n = 12 choices of 256 logit_bias entries each (3,072, past the step's 2,048 places): the
    scheduler runs 8 at a time (max_num_seqs is 16), and every choice finishes forced."""
    bias = {str(t): -1.0 for t in range(100, 355)} | {"77": 100}
    resp = oai.completions.create(
        model=MODEL_NAME,
        prompt=[5, 6, 7],
        max_tokens=40,
        n=12,
        temperature=1.0,
        seed=9,
        logit_bias=bias,
        extra_body={"ignore_eos": True},
    )
    forced = oai.completions.create(
        model=MODEL_NAME, prompt=[5, 6, 7], max_tokens=40, logit_bias={"77": 100}, **GREEDY
    )
    assert len(resp.choices) == 12
    assert {c.text for c in resp.choices} == {forced.choices[0].text}


def test_chat(server: Server, oai: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    resp = oai.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=8, logprobs=True, **GREEDY
    )
    rendered = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    assert resp.usage.prompt_tokens == len(rendered + "<|im_start|>assistant\n")
    msg = resp.choices[0].message
    assert msg.role == "assistant" and resp.choices[0].finish_reason == "length"
    assert len(resp.choices[0].logprobs.content) == 8
    assert "metrics" in resp.model_extra
    # The chat template is applied exactly: the same prompt as text gives the same answer.
    assert msg.content == generate(server, rendered + "<|im_start|>assistant\n", 8)["text"]
    assert CHAT_TEMPLATE  # (the template the server was given)


def test_chat_stream(oai: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "count"}]
    whole = oai.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=9, **GREEDY)
    chunks = list(
        oai.chat.completions.create(
            model=MODEL_NAME,
            messages=messages,
            max_tokens=9,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == 9


def test_chat_max_tokens_defaults_to_the_room_left(oai: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "x" * 100}]
    resp = oai.chat.completions.create(model=MODEL_NAME, messages=messages, **GREEDY)
    assert resp.usage.total_tokens == 256  # max_model_len
    assert resp.choices[0].finish_reason == "length"


def test_generate_streams_one_line_per_step(server: Server, slow_steps) -> None:
    # (slow steps: a reader that keeps up gets each token on its own line; one that falls behind,
    # as on a loaded machine, gets the tokens waiting for it merged into one line)
    whole = generate(server, "lines", 7)
    with client(server) as c:
        with c.stream(
            "POST",
            "/generate",
            json={
                "prompt": "lines",
                "max_tokens": 7,
                "stream": True,
                "temperature": 0,
                "ignore_eos": True,
            },
        ) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("application/x-ndjson")
            lines = [json.loads(line) for line in r.iter_lines() if line]
    assert 2 <= len(lines) <= 7 and all(line["token_ids"] for line in lines)
    assert [t for line in lines for t in line["token_ids"]] == whole["token_ids"]
    assert "".join(line["text"] for line in lines) == whole["text"]
    assert [line["finish_reason"] for line in lines] == [None] * (len(lines) - 1) + ["length"]
    assert lines[-1]["usage"] == {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}
    assert lines[-1]["metrics"]["e2e_latency"] > 0


def test_echo_puts_the_prompt_before_each_choice(oai: openai.OpenAI) -> None:
    alone = oai.completions.create(model=MODEL_NAME, prompt="echo me", max_tokens=5, **GREEDY)
    text = alone.choices[0].text
    whole = oai.completions.create(
        model=MODEL_NAME, prompt="echo me", max_tokens=5, echo=True, n=2, **GREEDY
    )
    assert [c.text for c in whole.choices] == ["echo me" + text] * 2
    assert whole.usage.completion_tokens == 2 * 5  # the prompt is not counted as output
    chunks = list(
        oai.completions.create(
            model=MODEL_NAME, prompt="echo me", max_tokens=5, echo=True, stream=True, **GREEDY
        )
    )
    assert chunks[0].choices[0].text == "echo me"  # the prompt first, before any token
    assert "".join(c.choices[0].text for c in chunks) == "echo me" + text
    ids = [72, 101, 108, 108, 111]  # token ids echo as their text ("Hello")
    by_ids = oai.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=3, echo=True, **GREEDY)
    assert by_ids.choices[0].text.startswith("Hello")


# ---- n: several choices of one prompt -------------------------------------------------------

SHARED = "shared prompt " * 5  # 70 tokens: four whole 16-token pages and 6 more


def test_n_choices_sample_with_consecutive_seeds_and_share_the_prompt(
    server: Server, oai: openai.OpenAI
) -> None:
    server.wait_idle()
    before = _scrape(server)
    sampled = {"temperature": 1.0, "extra_body": {"ignore_eos": True}}
    resp = oai.completions.create(
        model=MODEL_NAME, prompt=SHARED, max_tokens=8, n=4, seed=7, **sampled
    )
    delta = {k: v - before.get(k, 0.0) for k, v in _scrape(server).items()}
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    assert resp.usage.prompt_tokens == 70 and resp.usage.completion_tokens == 4 * 8
    # Choice i is what the same request alone with seed 7 + i answers.
    for c in resp.choices:
        alone = oai.completions.create(
            model=MODEL_NAME, prompt=SHARED, max_tokens=8, seed=7 + c.index, **sampled
        )
        assert c.text == alone.choices[0].text
        assert c.model_extra["metrics"]["e2e_latency"] > 0  # each choice's own timings
    assert len({c.text for c in resp.choices}) > 1
    assert "metrics" not in resp.model_extra  # per choice instead
    with client(server) as c:  # as /openapi.json says
        schemas = c.get("/openapi.json").json()["components"]["schemas"]
    for answer, choice in (
        ("CompletionResponse", "CompletionChoice"),
        ("ChatCompletionResponse", "ChatChoice"),
    ):
        assert "metrics" not in schemas[answer]["required"]
        assert "metrics" in schemas[choice]["properties"]
    # The prompt's four full pages were computed once: the other three choices read them.
    assert delta["nori:prefix_cache_hits_total"] >= 3 * 64


def test_n_greedy_choices_are_equal(oai: openai.OpenAI) -> None:
    resp = oai.completions.create(model=MODEL_NAME, prompt="same", max_tokens=6, n=3, **GREEDY)
    one = oai.completions.create(model=MODEL_NAME, prompt="same", max_tokens=6, **GREEDY)
    assert [c.text for c in resp.choices] == [one.choices[0].text] * 3


def test_n_chat_stream_interleaves_choices_that_match_the_whole_answer(
    oai: openai.OpenAI,
) -> None:
    messages = [{"role": "user", "content": "three ways"}]
    sampled = {"temperature": 1.0, "seed": 11, "extra_body": {"ignore_eos": True}}
    whole = oai.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=7, n=3, **sampled
    )
    chunks = list(
        oai.chat.completions.create(
            model=MODEL_NAME,
            messages=messages,
            max_tokens=7,
            n=3,
            stream=True,
            stream_options={"include_usage": True},
            **sampled,
        )
    )
    texts, roles, finishes = ["", "", ""], [], []
    for c in chunks[:-1]:
        (choice,) = c.choices
        if choice.delta.role:
            roles.append(choice.index)
        texts[choice.index] += choice.delta.content or ""
        if choice.finish_reason:
            finishes.append(choice.index)
    assert roles == [0, 1, 2]  # each choice's role first, before any text
    assert sorted(finishes) == [0, 1, 2]
    assert texts == [c.message.content for c in whole.choices]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3 * 7
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_n_stream_disconnect_aborts_every_choice(server: Server, slow_steps) -> None:
    server.wait_idle()
    before = server.engine.get_metrics()["nori:request_success_total"]
    body = {"prompt": "go", "max_tokens": 200, "ignore_eos": True, "n": 3, "stream": True}
    with client(server) as c, c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        next(r.iter_lines())  # the first choice's first token: all three are running
    server.wait_idle()
    after = server.engine.get_metrics()["nori:request_success_total"]
    assert after.get("abort", 0) - before.get("abort", 0) == 3
    assert after.get("length", 0) == before.get("length", 0)


def _scrape(server: Server) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics").text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + "".join(f"[{v}]" for k, v in sorted(s.labels.items()) if k != "le")
            if "le" not in s.labels:
                samples[key] = s.value
    return samples


def test_metrics_count_what_was_done(server: Server, oai: openai.OpenAI) -> None:
    server.wait_idle()
    before = _scrape(server)
    prompts = ["a", "bb", "ccc"]
    for p in prompts:
        oai.completions.create(model=MODEL_NAME, prompt=p, max_tokens=5, **GREEDY)
    list(
        oai.completions.create(model=MODEL_NAME, prompt="dddd", max_tokens=4, stream=True, **GREEDY)
    )
    generate(server, "eeeee", 3)
    server.wait_idle()
    after = _scrape(server)
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    assert delta["nori:request_success_total[length]"] == 5
    assert (
        delta["nori:request_success_total[stop]"] + delta["nori:request_success_total[abort]"] == 0
    )
    assert delta["nori:prompt_tokens_total"] == 1 + 2 + 3 + 4 + 5
    assert delta["nori:generation_tokens_total"] == 3 * 5 + 4 + 3
    for hist in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "time_per_output_token_seconds",
    ):
        assert delta[f"nori:{hist}_count"] == 5, hist
        assert delta[f"nori:{hist}_sum"] >= 0.0
    assert delta["nori:step_duration_seconds_count"] >= 5
    # Launches by token bucket and kind: prompts prefilled (alone or beside decodes), then
    # decoded; each with its wall time.
    launches = {k: v for k, v in delta.items() if k.startswith("nori:step_launches_total[")}
    assert sum(launches.values()) >= 5
    kinds = {k.rsplit("[", 1)[1].rstrip("]") for k, v in launches.items() if v}
    assert "decode" in kinds and kinds & {"prefill", "mixed"}
    assert kinds <= {"decode", "mixed", "prefill"}
    for key, n in launches.items():
        seconds = delta[key.replace("step_launches_total", "step_launch_seconds_total")]
        assert (seconds > 0) == (n > 0)
    assert server.engine.get_metrics()["nori:step_launches_total"]  # "16/decode": count
    assert after["nori:num_requests_running"] == after["nori:num_requests_waiting"] == 0
    assert after["nori:kv_cache_usage_perc"] == 0.0
    assert after["nori:recompiles_total"] == 0
    assert after["nori:num_preemptions_total"] == 0


def test_async_engine_in_process(server: Server) -> None:
    """The library's async API under the server: same tokens, and breaking off frees the pages."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    async def run() -> tuple[list[int], int]:
        outs = [out async for out in server.engine.generate("in process", params)]
        assert outs[-1].finished and sum(len(o.new_token_ids) for o in outs) == 6
        server.wait_idle()
        free = server.free_pages()
        long = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
        gen = server.engine.generate("break off", long)
        seen = 0
        async for out in gen:
            assert out.token_ids is None and not out.finished  # deltas until the end
            seen += len(out.new_token_ids)
            if seen >= 3:
                break
        await gen.aclose()  # runs the generator's `finally`: the request is aborted
        # A reader that falls behind gets what waits for it merged into one output.
        stream = await server.engine.add_request("in process", params)
        while server.engine.num_in_flight:
            await asyncio.sleep(0.01)
        merged = [out async for out in stream]
        assert len(merged) == 1 and merged[0].finished
        assert merged[0].new_token_ids == merged[0].token_ids == outs[-1].token_ids
        assert merged[0].new_text == merged[0].text == outs[-1].text
        # ... their logprobs and top logprobs too, one per token
        top = dataclasses.replace(params, logprobs=2)
        stream = await server.engine.add_request("in process", top)
        while server.engine.num_in_flight:
            await asyncio.sleep(0.01)
        (merged,) = [out async for out in stream]
        assert len(merged.new_logprobs) == len(merged.new_top_logprobs) == 6
        assert merged.new_top_logprobs == merged.top_logprobs
        assert [p[0][0] for p in merged.top_logprobs] == merged.token_ids  # greedy: the top one
        return outs[-1].token_ids, free

    ids, free = asyncio.run(run())
    assert ids == generate(server, "in process", 6)["token_ids"]
    server.wait_idle()
    assert server.free_pages() == free


def test_a_batch_of_prompts_answers_n_choices_of_each(oai: openai.OpenAI) -> None:
    """OpenAI's legacy batch: `prompt` a list of texts (or of id lists); choice i * n + j is
    prompt i's j-th, each as the prompt alone would be answered; usage counts each prompt once.
    Streamed, the chunks carry those indexes; echo with logprobs scores each prompt (what
    lm-evaluation-harness sends with a batch size above 1)."""
    prompts = ["Hello", "Once upon a time"]
    resp = oai.completions.create(
        model=MODEL_NAME, prompt=prompts, max_tokens=4, n=2, echo=True, **GREEDY
    )
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    alone = [
        oai.completions.create(model=MODEL_NAME, prompt=p, max_tokens=4, echo=True, **GREEDY)
        for p in prompts
    ]
    assert [c.text for c in resp.choices] == [a.choices[0].text for a in alone for _ in (0, 1)]
    assert resp.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert resp.usage.completion_tokens == 4 * 4
    streamed = oai.completions.create(
        model=MODEL_NAME,
        prompt=prompts,
        max_tokens=4,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    texts = ["", "", "", ""]
    usage = None
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.text
        usage = chunk.usage or usage
    plain = [
        oai.completions.create(model=MODEL_NAME, prompt=p, max_tokens=4, **GREEDY).choices[0].text
        for p in prompts
    ]
    assert texts == [plain[0], plain[0], plain[1], plain[1]]
    assert [a.choices[0].text for a in alone] == [
        p + t for p, t in zip(prompts, plain, strict=True)
    ]
    assert usage.prompt_tokens == resp.usage.prompt_tokens
    ids = [[72, 101, 108, 108, 111], [79, 110, 99, 101]]
    scored = oai.completions.create(
        model=MODEL_NAME, prompt=ids, max_tokens=1, logprobs=1, echo=True, temperature=0
    )
    for choice, prompt in zip(scored.choices, ids, strict=True):
        one = oai.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=1, logprobs=1, echo=True, temperature=0
        )
        assert choice.logprobs.token_logprobs == one.choices[0].logprobs.token_logprobs
        assert choice.logprobs.token_logprobs[0] is None
        assert len(choice.logprobs.tokens) == len(prompt) + 1
