"""`nori-jax bench offline` end to end on a tiny preset (CPU numbers mean nothing; shape does)."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from nori_jax.bench.offline import add_bench_offline_parser, config_from_args, draw_requests
from nori_jax.cli import main


def _offline_config(*argv: str):
    parser = argparse.ArgumentParser()
    add_bench_offline_parser(parser.add_subparsers())
    return config_from_args(parser.parse_args(["offline", *argv]))


def test_bench_offline_runs_and_writes_json(tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = main([
        "--log-level", "WARNING", "bench", "offline", "--config", "tiny-cpu",
        "--num-prompts", "12", "--warmup-requests", "2", "--input-max", "200",
        "--output-max", "20", "--shared-prefix-len", "32", "--long-prompts", "1",
        "--long-len", "240", "--request-rate", "200", "--result-json", str(out),
        "--sampling", '{"presence_penalty": 0.5, "min_tokens": 4}', "--sampling-share", "0.5",
    ])  # fmt: skip
    assert rc == 0
    printed = capsys.readouterr().out
    assert "Offline Benchmark Result" in printed and "Wall time by step shape" in printed
    r = json.loads(out.read_text())
    assert r["num_requests"] == 12 and r["num_recompiles"] == 0
    assert 0 < r["num_sampled_requests"] < 12  # penalties and min_tokens compiled ahead too
    assert r["output_tokens"] > 0 and r["total_token_throughput"] > 0
    # the long prompt (240 tokens after a 32-token prefix) does not fit tiny-cpu's 256
    assert 1 <= r["num_clamped_requests"] < 12
    assert r["steps"] > 0 and 0 <= r["padding_fraction"] < 1 and r["startup_s"] > 0
    assert r["prefix_cache_hit_rate"] > 0  # the shared 32-token prefix is two full pages
    assert r["latency_ms"]["ttft_short"]["p99"] <= r["latency_ms"]["e2e_all"]["p99"]
    assert r["config"]["model"] == "tiny-llama"
    # The measured steps by shape: every launch once, the warm-up's left out.
    shapes = r["step_shapes"]
    assert sum(row["launches"] for row in shapes) == r["steps"]
    tokens = sum(row["tokens_per_launch"] * row["launches"] for row in shapes)
    assert tokens == pytest.approx(r["mean_tokens_per_step"] * r["steps"])
    assert {row["kind"] for row in shapes} <= {"decode", "mixed", "prefill"}
    assert {"decode", "prefill"} & {row["kind"] for row in shapes}
    assert sum(row["share"] for row in shapes) == pytest.approx(1.0)
    assert 0 < sum(row["seconds"] for row in shapes) <= r["elapsed_s"]


def test_workload_is_the_same_draw_in_every_run():
    """Two runs with default flags must compare the same requests (the workload seed is the
    bench's own, not the engine's --seed, which defaults to None)."""
    argv = ["--num-prompts", "20", "--shared-prefix-len", "8", "--long-prompts", "2"]
    a, b = (draw_requests(_offline_config(*argv), 1000, 4096) for _ in range(2))
    assert a.prompts == b.prompts and a.output_lens == b.output_lens
    assert sum(a.is_long) == 2 and all(p[:8] == a.prompts[0][:8] for p in a.prompts)
    c = draw_requests(_offline_config(*argv, "--bench-seed", "1"), 1000, 4096)
    assert c.prompts != a.prompts


def test_sampling_share_marks_measured_requests_only_and_changes_no_draw():
    argv = ["--num-prompts", "200", "--warmup-requests", "5"]
    plain = draw_requests(_offline_config(*argv), 1000, 4096)
    sampling = ["--sampling", '{"min_tokens": 1000}', "--sampling-share", "0.25"]
    cfg = _offline_config(*argv, *sampling)
    mixed = draw_requests(cfg, 1000, 4096)
    assert mixed.prompts == plain.prompts and mixed.output_lens == plain.output_lens
    assert not any(plain.sampled) and not any(mixed.sampled[:5])
    assert 30 <= sum(mixed.sampled) <= 70  # a quarter of 200, seeded
    assert mixed.sampled == draw_requests(cfg, 1000, 4096).sampled
    every = draw_requests(_offline_config(*argv, "--sampling", '{"min_tokens": 1}'), 1000, 4096)
    assert every.sampled == [False] * 5 + [True] * 200  # the share defaults to all measured
    from nori_jax.bench.offline import request_params

    p = request_params(cfg, 7)  # min_tokens capped at the drawn output length
    assert (p.min_tokens, p.max_tokens, p.temperature, p.ignore_eos) == (7, 7, 0.0, True)
    assert request_params(cfg, 7, sampled=False).min_tokens == 0


def test_offline_draws_the_lengths_bench_serve_sends():
    """Same seed, same lengths (warm-up and measured) as `bench serve`: offline and served runs
    of one seed compare the same workload."""
    from nori_jax.bench.config import BenchConfig
    from nori_jax.bench.run import prepare_workload

    cfg = _offline_config("--num-prompts", "30", "--warmup-requests", "4")
    offline = draw_requests(cfg, 50_000, 1 << 20)
    served = prepare_workload(BenchConfig("http://127.0.0.1:9", cfg.workload, model="m"))
    reqs = served.warmup + served.requests
    assert [len(p) for p in offline.prompts] == [r.prompt_len for r in reqs]
    assert offline.output_lens == [r.output_len for r in reqs]
    assert np.std([len(p) for p in offline.prompts]) > 0  # lognormal, not a constant


def test_requests_cut_to_the_context_are_counted_and_said(caplog):
    """bench serve sends the drawn lengths as they are; offline has to cut what does not fit
    max_model_len, and says how many (a different workload from the same seed)."""
    cfg = _offline_config("--num-prompts", "30", "--warmup-requests", "4")
    assert draw_requests(cfg, 50_000, 1 << 20).clamped == 0
    with caplog.at_level("WARNING", logger="nori_jax.bench.offline"):
        short = draw_requests(cfg, 50_000, 256)
    assert 0 < short.clamped <= 30
    assert f"{short.clamped} of 30 requests were cut to fit max_model_len=256" in caplog.text
    assert all(len(p) + o <= 256 for p, o in zip(short.prompts, short.output_lens, strict=True))


def test_bad_workload_flags_exit_2_before_loading_a_model(capsys):
    base = ["bench", "offline", "--model", "tiny-llama", "--load-format", "dummy"]
    for bad in (
        ["--request-rate", "0"],
        ["--num-prompts", "0"],
        ["--num-prompts", "3", "--long-prompts", "4"],
        ["--sampling-share", "1.5"],
        ["--sampling", "{presence_penalty: 1}"],
        ["--sampling", "[1, 2]"],
        ["--sampling", '{"presence_penalty": 3}'],
        ["--sampling", '{"no_such_field": 1}'],
    ):
        assert main([*base, *bad]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and bad[-2].strip("-").split("-")[0] in err


def test_a_shared_prefix_that_fills_the_context_is_refused_naming_flag_and_limit():
    cfg = _offline_config("--num-prompts", "4", "--shared-prefix-len", "256")
    with pytest.raises(
        ValueError, match=r"--shared-prefix-len 256 .* max_model_len=256: it must be at most 254"
    ):
        draw_requests(cfg, 50_000, 256)
    assert (
        draw_requests(cfg, 50_000, 258).prompts[0][:256]
        == draw_requests(cfg, 50_000, 258).prompts[1][:256]
    )


def test_a_burstiness_without_a_schedule_is_refused_before_loading_a_model(capsys):
    """Gaps of shape 1e-4 underflow to 0: the schedule would be NaN and the loop would spin."""
    base = ["bench", "offline", "--model", "tiny-llama", "--load-format", "dummy"]
    assert main([*base, "--burstiness", "1e-4", "--num-prompts", "5", "--request-rate", "2"]) == 2
    assert "burstiness 0.0001 is too small" in capsys.readouterr().err
