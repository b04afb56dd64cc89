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
