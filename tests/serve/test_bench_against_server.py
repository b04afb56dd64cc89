"""`nori-jax bench serve` against the real server (tiny preset), as the README runs it: no
--tokenizer (the server's model card names its preset, whose byte-level vocabulary the client
rebuilds), text prompts of exactly the drawn lengths, every request accounted for in /metrics,
and the engine's steps over the run read from /metrics (server_metrics.py)."""

from __future__ import annotations

import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_harness import Server, running_server

from nori_jax.bench.cli import main as bench_main


@pytest.fixture(scope="module")
def server():
    with running_server({"model_name": "tiny-llama"}) as s:  # as `serve --config tiny-cpu`
        yield s


def _success_total(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    for family in text_string_to_metric_families(text):
        if family.name == "nori:request_success":
            return sum(s.value for s in family.samples if s.name.endswith("_total"))
    raise AssertionError("nori:request_success missing")


def test_short_bench_run_against_the_real_server(server: Server, tmp_path, capsys):
    before = _success_total(server.url)
    out = tmp_path / "r.json"
    rc = bench_main([
        "serve", "--base-url", server.url, "--ignore-eos",
        "--num-prompts", "12", "--request-rate", "50", "--input-max", "120",
        "--output-max", "24", "--seed", "3", "--result-json", str(out), "--disable-tqdm",
        "--num-client-processes", "1",
    ])  # fmt: skip
    assert rc == 0
    printed = capsys.readouterr().out
    assert "tokenizer: preset tiny-llama (byte-level)" in printed
    assert "Server (engine steps, from /metrics)" in printed and "Engine steps:" in printed
    r = json.loads(out.read_text())
    assert r["completed"] == 12 and r["failed"] == 0
    assert r["tokenizer_id"] == "preset tiny-llama (byte-level)"
    assert not [w for w in r["warnings"] if "prompt lengths" in w or "estimates" in w]
    assert r["total_input_tokens"] == sum(r["input_lens"])
    assert r["total_output_tokens"] == sum(r["output_lens"]) > 0
    assert r["mean_ttft_ms"] > 0 and r["request_throughput"] > 0
    # the server's own view of the run: one token per request per step at most
    assert r["server_metrics_error"] is None
    assert r["server_steps"] >= max(r["output_lens"])
    assert r["server_mean_step_ms"] > 0 and r["server_mean_scheduler_ms"] > 0
    tokens = r["server_tokens_per_step"] * r["server_steps"]  # the run's requests, no others
    assert tokens == pytest.approx(r["total_input_tokens"] + r["total_output_tokens"])
    # its launches by shape (one step a launch here; an engine step that only fetched the
    # previous launch's samples launched nothing): every output token took a launch, the
    # prompts' as prefill or mixed
    shapes = r["server_step_shapes"]
    assert max(r["output_lens"]) <= sum(s["launches"] for s in shapes) <= r["server_steps"]
    assert {s["kind"] for s in shapes} >= {"decode"} and {s["kind"] for s in shapes} & {
        "prefill",
        "mixed",
    }
    assert sum(s["share"] for s in shapes) == pytest.approx(1.0)
    assert "Launches by step shape" in printed
    server.wait_idle()
    assert _success_total(server.url) - before == 12
