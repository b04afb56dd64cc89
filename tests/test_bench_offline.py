"""`nori-jax bench offline` end to end on a tiny preset (CPU numbers mean nothing; shape does)."""

from __future__ import annotations

import json

from nori_jax.cli import main


def test_bench_offline_runs_and_writes_json(tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = main(
        [
            "--log-level",
            "WARNING",
            "bench",
            "offline",
            "--model",
            "tiny-llama",
            "--load-format",
            "dummy",
            "--page-size",
            "16",
            "--num-pages",
            "256",
            "--max-num-seqs",
            "8",
            "--max-num-batched-tokens",
            "64",
            "--max-model-len",
            "512",
            "--num-prompts",
            "12",
            "--warmup-requests",
            "2",
            "--input-max",
            "200",
            "--output-max",
            "20",
            "--shared-prefix-len",
            "32",
            "--long-prompts",
            "1",
            "--long-len",
            "300",
            "--request-rate",
            "200",
            "--result-json",
            str(out),
        ]
    )
    assert rc == 0
    assert "Offline Benchmark Result" in capsys.readouterr().out
    r = json.loads(out.read_text())
    assert r["num_requests"] == 12 and r["num_recompiles"] == 0
    assert r["output_tokens"] > 0 and r["total_token_throughput"] > 0
    assert r["prefix_cache_hit_rate"] > 0  # the shared 32-token prefix is two full pages
    assert r["latency_ms"]["ttft_short"]["p99"] <= r["latency_ms"]["e2e_all"]["p99"]


def test_workload_is_the_same_draw_in_every_run():
    """Two runs with default flags must compare the same requests (the workload seed is the
    bench's own, not the engine's --seed, which defaults to None)."""
    import argparse

    from nori_jax.bench.offline import add_bench_offline_parser, draw_workload

    parser = argparse.ArgumentParser()
    add_bench_offline_parser(parser.add_subparsers())
    argv = ["offline", "--num-prompts", "20", "--shared-prefix-len", "8", "--long-prompts", "2"]
    a, b = (draw_workload(parser.parse_args(argv), 1000, 4096) for _ in range(2))
    assert a.prompts == b.prompts and a.output_lens == b.output_lens
    c = draw_workload(parser.parse_args([*argv, "--bench-seed", "1"]), 1000, 4096)
    assert c.prompts != a.prompts


def test_offline_draws_the_lengths_bench_serve_sends():
    """Same seed, same lengths (warm-up and measured) as `bench serve`: offline and served runs
    of one seed compare the same workload."""
    import argparse

    import numpy as np

    from nori_jax.bench.config import DatasetConfig
    from nori_jax.bench.dataset import build_requests
    from nori_jax.bench.offline import add_bench_offline_parser, draw_workload
    from nori_jax.bench.prompts import WordPrompts
    from nori_jax.bench.runner import seeded_streams

    parser = argparse.ArgumentParser()
    add_bench_offline_parser(parser.add_subparsers())
    args = parser.parse_args(["offline", "--num-prompts", "30", "--warmup-requests", "4"])
    w = draw_workload(args, 50_000, 1 << 20)
    data_rng, warm_rng, _ = seeded_streams(0)
    served = [
        *build_requests(DatasetConfig(num_prompts=4), WordPrompts("completions"), 4, warm_rng),
        *build_requests(DatasetConfig(num_prompts=30), WordPrompts("completions"), 30, data_rng),
    ]
    assert [len(p) for p in w.prompts] == [r.prompt_len for r in served]
    assert w.output_lens == [r.output_len for r in served]
    assert np.std([len(p) for p in w.prompts]) > 0  # lognormal, not a constant


def test_bad_workload_flags_exit_2_before_loading_a_model(capsys):
    base = ["bench", "offline", "--model", "tiny-llama", "--load-format", "dummy"]
    for bad in (
        ["--request-rate", "0"],
        ["--num-prompts", "0"],
        ["--num-prompts", "3", "--long-prompts", "4"],
    ):
        assert main([*base, *bad]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and bad[-2] in err
