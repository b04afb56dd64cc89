"""`nori-jax run-batch` and `LLM.generate_stream` on the tiny-cpu engine (one engine for the
module): the server's bodies, error lines, shards, bounded read-ahead, and resume after a
SIGKILL and after an error, each custom_id answered exactly once."""

from __future__ import annotations

import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from nori_jax import LLM, EngineConfig, SamplingParams
from nori_jax.async_engine import AsyncEngine
from serve.api import create_app
from serve.batch.runner import BatchOptions, run_batch
from serve.settings import ServerSettings

MODEL = "tiny"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM.from_config(EngineConfig.from_yaml("tiny-cpu"))


def options(**kw: Any) -> BatchOptions:
    return BatchOptions(**({"model_name": MODEL, "progress": False} | kw))


def line(custom_id: str, body: dict, url: str = "/v1/completions") -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def read_output(path: Path) -> dict[str | None, dict]:
    records = [json.loads(x) for x in path.read_text().splitlines()]
    counts = collections.Counter(r["custom_id"] for r in records)
    assert all(n == 1 for cid, n in counts.items() if cid is not None), counts.most_common(3)
    return {r["custom_id"]: r for r in records}


def comparable(body: dict) -> dict:
    """An answer without what differs between two runs of one request: ids, clock, timings
    (with n > 1, each choice's own)."""
    kept = {k: v for k, v in body.items() if k not in ("id", "created", "metrics")}
    if "choices" in kept:
        kept["choices"] = [{k: v for k, v in c.items() if k != "metrics"} for c in kept["choices"]]
    return kept


REQUESTS = [
    ("text", "/v1/completions", {"model": MODEL, "prompt": "The capital of", "max_tokens": 6}),
    ("ids", "/v1/completions", {"prompt": [5, 9, 33, 40], "max_tokens": 5, "logprobs": 0}),
    (
        "chat",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 4, "logprobs": True},
    ),
    ("stop", "/v1/completions", {"prompt": "abc", "max_tokens": 8, "stop": ["\n"], "seed": 3}),
    (  # three sampled choices: choice i with seed 11 + i, as the server samples them
        "choices",
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "go"}],
            "max_tokens": 6,
            "n": 3,
            "temperature": 1.0,
            "seed": 11,
        },
    ),  # fmt: skip
    ("bad-type", "/v1/completions", {"prompt": "x", "top_p": "high"}),
    ("extra-field", "/v1/completions", {"prompt": "x", "best_of_n": 2}),
    ("other-model", "/v1/completions", {"model": "gpt-4o", "prompt": "x"}),
    ("too-long", "/v1/completions", {"prompt": "x" * 300, "max_tokens": 4}),
    (
        "no-room",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "y"}], "max_tokens": 400},
    ),
]


def test_bodies_are_the_servers(llm: LLM, tmp_path: Path) -> None:
    """Each request answered over HTTP and from a batch file: the same status and body (greedy,
    or seeded), apart from ids and timings."""
    settings = ServerSettings(model_name=MODEL, chat_template=CHAT_TEMPLATE)
    served = {}
    with TestClient(create_app(AsyncEngine(llm.engine), settings)) as http:
        for cid, url, body in REQUESTS:
            r = http.post(url, json=GREEDY | body)
            served[cid] = (r.status_code, r.json())
    assert not llm.engine.has_unfinished_requests()  # the server's thread has stopped
    src = write_jsonl(tmp_path / "in.jsonl", [line(c, GREEDY | b, u) for c, u, b in REQUESTS])
    out = tmp_path / "out.jsonl"
    summary = run_batch(
        llm.engine, str(src), str(out), options(chat_template=CHAT_TEMPLATE, max_concurrency=1)
    )
    got = read_output(out)
    assert set(got) == {c for c, _, _ in REQUESTS}
    for cid, (status, body) in served.items():
        record = got[cid]
        assert record["error"] is None
        response = record["response"]
        assert response["status_code"] == status, (cid, response)
        assert comparable(response["body"]) == comparable(body), cid
        if status == 200:
            assert response["body"]["id"] == response["request_id"]
    answered = {"text", "ids", "chat", "stop", "choices"}
    assert {c for c, (s, _) in served.items() if s == 200} == answered
    choices = got["choices"]["response"]["body"]["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert len({c["message"]["content"] for c in choices}) > 1  # seeds apart, samples apart
    assert summary.run.requests == len(REQUESTS) and summary.run.failed == 5
    assert summary.run.completion_tokens == sum(
        got[c]["response"]["body"]["usage"]["completion_tokens"] for c in answered
    )
    assert summary.run.prompt_tokens == sum(
        got[c]["response"]["body"]["usage"]["prompt_tokens"] for c in answered
    )


def test_malformed_lines_get_error_lines_and_the_job_goes_on(llm: LLM, tmp_path: Path) -> None:
    good = {"prompt": "ok", "max_tokens": 2}
    rows = [
        line("a", good),
        "{not json",
        line("b", good),
        json.dumps([1, 2]),  # JSON, not an object
        {"custom_id": "get", "method": "GET", "url": "/v1/completions", "body": good},
        {"custom_id": "emb", "method": "POST", "url": "/v1/embeddings", "body": good},
        {"method": "POST", "url": "/v1/completions", "body": good},  # no custom_id
        line("not-a-dict", "prompt"),  # type: ignore[arg-type]
        line("streamed", good | {"stream": True}),
        line("choices", good | {"n": 2}),  # fine: a line's choices are requests of their own
        line("prompts", good | {"prompt": ["one", "two"]}),  # a batch of prompts in one line
        line("huge", {"prompt": "z" * 400}),  # over --max-line-bytes
        line("c", good),
    ]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    summary = run_batch(llm.engine, str(src), str(out), options(max_line_bytes=300))
    records = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(records) == len(rows)
    by_id = {r["custom_id"]: r for r in records if r["custom_id"] is not None}
    for cid in ("a", "b", "c", "choices"):
        assert by_id[cid]["response"]["status_code"] == 200
    assert len(by_id["choices"]["response"]["body"]["choices"]) == 2
    line_errors = {
        (r["custom_id"], r["error"]["code"], r["error"]["message"].split(":")[0])
        for r in records
        if r["error"] is not None
    }
    assert line_errors == {
        (None, "invalid_json", "line 2"),
        (None, "invalid_batch_line", "line 4"),
        ("get", "invalid_batch_line", "line 5"),
        ("emb", "invalid_batch_line", "line 6"),
        (None, "invalid_batch_line", "line 7"),
        ("not-a-dict", "invalid_batch_line", "line 8"),
        (None, "line_too_long", "line 12"),
    }
    assert all(r["response"] is None for r in records if r["error"] is not None)
    streamed = by_id["streamed"]["response"]
    assert streamed["status_code"] == 400 and streamed["body"]["error"]["param"] == "stream"
    prompts = by_id["prompts"]["response"]
    assert prompts["status_code"] == 400 and prompts["body"]["error"]["param"] == "prompt"
    assert summary.run.requests == len(rows) and summary.run.failed == len(rows) - 4


def test_lines_that_broke_the_job_are_refused_alone(llm: LLM, tmp_path: Path) -> None:
    """A line nested deeper than the JSON parser's recursion, and one whose custom_id the output
    cannot hold (a lone surrogate), stopped the job and every rerun at that line: now each gets
    its error line, and its neighbours their answers."""
    good = {"prompt": "ok", "max_tokens": 2}
    rows = [
        line("a", good),
        "[" * 100_000 + "]" * 100_000,
        '{"custom_id": "s\\ud800", "method": "POST", "url": "/v1/completions", "body": {}}',
        line("b", good),
    ]
    out = tmp_path / "out.jsonl"
    run_batch(llm.engine, str(write_jsonl(tmp_path / "in.jsonl", rows)), str(out), options())
    records = [json.loads(x) for x in out.read_text().splitlines()]
    errors = {
        (r["custom_id"], r["error"]["code"], r["error"]["message"].split(":")[0])
        for r in records
        if r["error"] is not None
    }
    assert errors == {(None, "invalid_json", "line 2"), (None, "invalid_batch_line", "line 3")}
    answered = {r["custom_id"] for r in records if r["error"] is None}
    assert answered == {"a", "b"}


def test_an_output_that_cannot_be_written_or_is_the_input_is_refused(tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [line("a", {"prompt": "ok"})])
    (tmp_path / "link.jsonl").hardlink_to(src)  # the input under another name
    for output, match in (
        (tmp_path / "link.jsonl", "is the input itself"),
        (tmp_path / "no-such-dir" / "out.jsonl", "cannot write the output"),
    ):
        with pytest.raises(ValueError, match=match):
            run_batch(None, str(src), str(output), options(overwrite=True))
    assert json.loads(src.read_text())["custom_id"] == "a"  # the input untouched


def test_two_shards_cover_the_file_once_with_bounded_read_ahead(llm: LLM, tmp_path: Path) -> None:
    rows = [line(f"r{i}", {"prompt": [1 + i % 50, 7], "max_tokens": 2}) for i in range(61)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    seen: list[str] = []
    for k in range(2):
        out = tmp_path / f"out{k}.jsonl"
        opts = options(shard_index=k, num_shards=2, read_ahead=6, max_concurrency=4)
        summary = run_batch(llm.engine, str(src), str(out), opts)
        assert summary.shard_requests == (31, 30)[k] == summary.run.requests
        assert 0 < summary.max_read_ahead <= 6
        seen += list(read_output(out))
    assert sorted(seen) == sorted(f"r{i}" for i in range(61))
    # A finished job run again does nothing; another shard count is another job.
    again = run_batch(
        llm.engine, str(src), str(tmp_path / "out0.jsonl"), options(shard_index=0, num_shards=2)
    )
    assert again.already_finished and again.run.requests == 0
    with pytest.raises(ValueError, match="checkpoint of another job"):
        run_batch(llm.engine, str(src), str(tmp_path / "out0.jsonl"), options())


def many_requests(n: int, max_tokens: int | None = None) -> list[dict]:
    """Requests of `max_tokens` tokens, or (None) of 1 to 12 tokens: they finish out of order."""
    return [
        line(
            f"req-{i}",
            {"prompt": [1 + i % 200, 2, 3], "max_tokens": max_tokens or 1 + i * 7 % 12} | GREEDY,
        )
        for i in range(n)
    ]


def test_resumes_after_sigkill_with_each_custom_id_once(llm: LLM, tmp_path: Path) -> None:
    """A run-batch process killed (SIGKILL) once it has committed some output, a torn line
    appended as a crash mid-write leaves one; the rerun (here in-process, same engine shapes)
    completes the job with every custom_id exactly once."""
    n = 400
    src = write_jsonl(tmp_path / "in.jsonl", many_requests(n, 16))
    out = tmp_path / "out.jsonl"
    ckpt = Path(f"{out}.checkpoint.json")
    exe = shutil.which("nori-jax") or str(Path(sys.executable).with_name("nori-jax"))
    cmd = [exe, "--log-level", "warning", "run-batch", "-i", str(src), "-o", str(out)]
    cmd += ["--config", "tiny-cpu", "--served-model-name", MODEL, "--max-concurrency", "4"]
    cmd += ["--flush-lines", "8", "--no-progress"]
    log = (tmp_path / "log").open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    deadline = time.monotonic() + 120
    committed = 0
    while committed == 0:
        assert proc.poll() is None, (tmp_path / "log").read_text()
        assert time.monotonic() < deadline, "run-batch committed nothing"
        time.sleep(0.02)
        try:
            committed = json.loads(ckpt.read_text())["totals"]["requests"]
        except (FileNotFoundError, json.JSONDecodeError):
            pass
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    log.close()
    killed = json.loads(ckpt.read_text())
    assert not killed["finished"] and 0 < killed["totals"]["requests"] < n
    with out.open("ab") as f:
        f.write(b'{"id": "batch_req_torn", "custom_id": "req-')
    summary = run_batch(llm.engine, str(src), str(out), options(max_concurrency=32))
    got = read_output(out)
    assert sorted(got) == sorted(f"req-{i}" for i in range(n))
    assert all(r["response"]["status_code"] == 200 for r in got.values())
    assert summary.job.requests == n == killed["totals"]["requests"] + summary.run.requests
    assert summary.job.completion_tokens == 16 * n


def test_resumes_after_an_error_mid_job(llm: LLM, tmp_path: Path) -> None:
    """The engine raises mid-job: what finished is committed on the way out, and a rerun
    completes the job, every custom_id once."""
    n = 120
    src = write_jsonl(tmp_path / "in.jsonl", many_requests(n))
    out = tmp_path / "out.jsonl"
    engine, real_step, steps = llm.engine, llm.engine.step, [0]

    def failing_step():
        steps[0] += 1
        if steps[0] == 30:
            raise RuntimeError("device lost")
        return real_step()

    engine.step = failing_step
    try:
        with pytest.raises(RuntimeError, match="device lost"):
            run_batch(engine, str(src), str(out), options(max_concurrency=8, flush_lines=1000))
    finally:
        del engine.step
    assert not engine.has_unfinished_requests()  # the requests in flight were aborted
    first = read_output(out)
    assert 0 < len(first) < n
    # Some requests finished before earlier ones: the rerun must skip them, not redo them.
    assert json.loads(Path(f"{out}.checkpoint.json").read_text())["committed_ahead"]
    run_batch(engine, str(src), str(out), options(max_concurrency=8))
    assert sorted(read_output(out)) == sorted(f"req-{i}" for i in range(n))


def test_generate_stream_reads_lazily_and_matches_generate(llm: LLM) -> None:
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    prompts = [[3 + i, 4, 5 + i % 7] for i in range(40)]
    pulled = [0]

    def lazily():
        for p in prompts:
            pulled[0] += 1
            yield p

    results = {}
    for i, out in llm.generate_stream(lazily(), params, max_in_flight=6):
        assert pulled[0] <= len(results) + 6 + 1  # in flight, plus one pulled and held back
        results[i] = out.token_ids
    assert sorted(results) == list(range(40))
    want = llm.generate((p for p in prompts), params)  # any iterable, read whole
    assert [results[i] for i in range(40)] == [o.token_ids for o in want]
    # Per-prompt settings; stopping early aborts what is in flight.
    stream = llm.generate_stream(
        [
            (p, SamplingParams(max_tokens=2 + i % 3, temperature=0.0, ignore_eos=True))
            for i, p in enumerate(prompts)
        ]
    )
    i, first = next(stream)
    assert len(first.token_ids) == 2 + i % 3
    stream.close()
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="max_in_flight=0"):
        next(llm.generate_stream(prompts, params, max_in_flight=0))
    with pytest.raises(ValueError, match="prompt 1: .*empty"):
        list(llm.generate_stream([[1, 2], [], [3]], params))
    assert not llm.engine.has_unfinished_requests()


def test_array_record_input(llm: LLM, tmp_path: Path) -> None:
    """The same requests from an ArrayRecord file (one JSON request per record) as from JSONL."""
    from array_record.python.array_record_module import ArrayRecordWriter

    rows = many_requests(12, 3)
    rows.insert(1, "not json")
    src = tmp_path / "in.array_record"
    writer = ArrayRecordWriter(str(src), "group_size:1")
    for r in rows:
        writer.write(r.encode() if isinstance(r, str) else json.dumps(r).encode())
    writer.close()
    out = tmp_path / "out.jsonl"
    summary = run_batch(llm.engine, str(src), str(out), options(num_shards=2, shard_index=1))
    got = read_output(out)
    # Shard 1 holds records 1, 3, ..., 11: the bad one, then req-2, req-4, ..., req-10.
    assert sorted(c for c in got if c) == sorted(f"req-{i}" for i in range(2, 12, 2))
    assert got[None]["error"]["code"] == "invalid_json"
    assert got[None]["error"]["message"].startswith("line 2:")
    assert summary.run.completion_tokens == 3 * 5
