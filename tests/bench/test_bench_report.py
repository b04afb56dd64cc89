"""Metric arithmetic, vLLM's result keys and printed block, the CSV, and the CLI end to end:
single runs, sweeps with their plot, bad flags, help lines, a missing extra, Ctrl-C."""

from __future__ import annotations

import argparse
import csv
import importlib.util
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from bench_helpers import REPO_ROOT, FakeServer, bench_config, run_bench

from nori_jax.bench import cli
from nori_jax.bench.client import RequestResult
from nori_jax.bench.metrics import compute_metrics
from nori_jax.bench.report import CSV_COLUMNS, print_run, result_dict
from nori_jax.bench.run import prepare_workload, run_once

# `vllm bench serve --save-result` keys (vllm/benchmarks/serve.py) that ours must carry as-is
VLLM_KEYS = {
    "date", "endpoint_type", "label", "model_id", "tokenizer_id", "num_prompts", "request_rate",
    "burstiness", "max_concurrency", "duration", "completed", "failed", "total_input_tokens",
    "total_output_tokens", "request_throughput", "request_goodput", "output_throughput",
    "total_token_throughput", "input_lens", "output_lens", "ttfts", "itls", "latencies",
    "start_times", "generated_texts", "errors", "max_output_tokens_per_s",
    "max_concurrent_requests",
} | {
    f"{stat}_{metric}_ms"
    for stat in ("mean", "median", "std", "p99")
    for metric in ("ttft", "tpot", "itl", "e2el")
}  # fmt: skip


def _ok(index: int, ttft: float, itls: list[float], out: int, sent: float = 0.0) -> RequestResult:
    return RequestResult(
        index, 0.0, 0.0, sent, success=True, error="", ttft_s=ttft, latency_s=ttft + sum(itls),
        itl_s=itls, output_tokens=out, output_tokens_source="usage",
    )  # fmt: skip


def test_metric_definitions_follow_vllm() -> None:
    results = [
        _ok(0, 0.100, [0.010, 0.030], 3),  # TPOT (0.14-0.10)/2 = 20 ms
        _ok(1, 0.300, [0.020], 2, sent=0.05),  # TPOT 20 ms
        _ok(2, 0.050, [], 1, sent=0.50),  # one token: no TPOT, TPOT 0 for goodput
        RequestResult(3, 0.0, 0.0, 0.0, success=False, error="HTTP 500"),
    ]
    m = compute_metrics(results, [10, 20, 30, 40], 2.0, (50.0, 99.0), {"ttft": 200, "tpot": 25})
    assert (m["completed"], m["failed"]) == (3, 1)
    assert m["total_input_tokens"] == 60 and m["total_output_tokens"] == 6
    assert m["output_lens"] == [3, 2, 1, 0]
    assert m["request_throughput"] == 1.5 and m["output_throughput"] == 3.0
    assert m["total_token_throughput"] == 33.0
    assert m["mean_ttft_ms"] == pytest.approx(150.0) and m["median_ttft_ms"] == pytest.approx(100.0)
    assert m["mean_tpot_ms"] == pytest.approx(20.0)
    assert m["mean_itl_ms"] == pytest.approx(20.0) and m["median_itl_ms"] == pytest.approx(20.0)
    assert m["p50_e2el_ms"] == pytest.approx(140.0)
    assert m["request_goodput"] == pytest.approx(1.0)  # requests 0 and 2 meet both SLOs
    assert m["max_concurrent_requests"] == 2  # [0, .14) and [.05, .37) overlap; [.5, .55) alone
    assert m["max_output_tokens_per_s"] == pytest.approx(6.0)  # all six tokens in second 0


def test_the_rate_achieved_and_the_ttft_growth_of_a_run() -> None:
    """Ten requests sent 0.5 s apart (2 req/s achieved, whatever was configured); the last fifth
    waited 4x longer for its first token than the first fifth: a queue that grew."""
    ttfts = [0.1, 0.1, 0.1, 0.2, 0.2, 0.2, 0.3, 0.3, 0.4, 0.4]
    results = [_ok(i, t, [0.01], 2, sent=0.5 * i) for i, t in enumerate(ttfts)]
    m = compute_metrics(results, [1] * 10, 5.0, (99.0,), {})
    assert m["achieved_request_rate"] == pytest.approx(2.0)
    assert m["ttft_growth"] == pytest.approx(4.0) and m["ttft_growth_ms"] == pytest.approx(300.0)
    steady = compute_metrics(
        [_ok(i, 0.1, [0.01], 2, sent=i) for i in range(10)], [1] * 10, 10.0, (99.0,), {}
    )
    assert steady["ttft_growth"] == pytest.approx(1.0)


def test_empty_metrics_report_zero_not_nan() -> None:
    m = compute_metrics([RequestResult(0, 0.0, error="x")], [5], 1.0, (99.0,), {})
    assert m["mean_ttft_ms"] == 0.0 and m["p99_itl_ms"] == 0.0 and m["request_goodput"] is None


def test_result_json_has_vllm_keys_and_the_block_prints(server: FakeServer) -> None:
    cfg = bench_config(
        server,
        {"request_rate": 200.0},
        metric_percentiles=(50.0, 99.0, 99.9),
        goodput_slos_ms={"ttft": 1000.0},
        max_concurrency=4,
    )
    workload = prepare_workload(cfg)
    run = run_once(cfg, workload, 200.0, lambda n: None)
    result = result_dict(cfg, workload, run)
    assert VLLM_KEYS <= result.keys()
    assert {"p50_ttft_ms", "p99.9_itl_ms"} <= result.keys()
    assert result["completed"] == 20 and result["request_goodput"] > 0
    assert len(result["itls"]) == 20 and len(result["ttfts"]) == 20
    json.dumps(result, allow_nan=False)
    out = io.StringIO()
    print_run(cfg, run, out)
    text = out.getvalue()
    for line in (
        "============ Serving Benchmark Result ============",
        "Successful requests:                     20",
        "Maximum request concurrency:             4",
        "Request rate configured (RPS):           200.00",
        "Request goodput (req/s):",
        "Total token throughput (tok/s):",
        "---------------Time to First Token----------------",
        "-----Time per Output Token (excl. 1st token)------",
        "P99.9 TTFT (ms):",
        "Median E2EL (ms):",
    ):
        assert line in text, line


def test_cli_single_run_writes_json_and_csv_with_failures(
    server: FakeServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server.set(fail_every=4)
    rj, rc = tmp_path / "r.json", tmp_path / "r.csv"
    code = cli.main([
        "serve", "--base-url", server.base_url, "--dataset", "fixed", "--num-prompts", "12",
        "--input-len", "20", "--output-len", "5", "--request-rate", "100", "--seed", "7",
        "--goodput", "ttft:500", "tpot:50", "--result-json", str(rj), "--result-csv", str(rc),
        "--num-client-processes", "1", "--disable-tqdm", "--ignore-eos",
    ])  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    assert "Serving Benchmark Result" in out and "Failed requests by reason (3)" in out
    result = json.loads(rj.read_text())
    assert result["model_id"] == "fake-model"  # discovered from /v1/models
    assert result["completed"] == 9 and result["failed"] == 3 and result["ignore_eos"] is True
    assert result["seed"] == 7 and result["interrupted"] is False
    rows = list(csv.DictReader(rc.open()))
    assert list(rows[0]) == list(CSV_COLUMNS) and len(rows) == 12
    failed = [r for r in rows if r["success"] == "0"]
    assert len(failed) == 3 and all(r["error"] == "HTTP 503: fake overload" for r in failed)
    ok = [r for r in rows if r["success"] == "1"]
    assert all(r["output_tokens"] == "5" and r["output_tokens_source"] == "usage" for r in ok)
    assert all(float(r["ttft_ms"]) > 0 and float(r["tpot_ms"]) > 0 for r in ok)


def test_cli_sweep_reports_a_knee_or_none_and_plots(
    server: FakeServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server.set(metrics="engine")  # a /metrics with this engine's step series
    rj = tmp_path / "sweep.json"
    code = cli.main([
        "serve", "--base-url", server.base_url, "--model", "fake-model", "--dataset", "fixed",
        "--num-prompts", "10", "--input-len", "8", "--output-len", "4", "--sweep", "50,100",
        "--result-json", str(rj), "--result-csv", str(tmp_path / "s.csv"), "--disable-tqdm",
        "--num-client-processes", "1",
    ])  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    assert "Rate sweep" in out and "Knee:" in out and "step ms" in out
    result = json.loads(rj.read_text())
    assert result["request_rates"] == [50.0, 100.0] and len(result["runs"]) == 2
    assert "knee_request_rate" in result and VLLM_KEYS <= result["runs"][0].keys()
    assert rj.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(list(csv.DictReader((tmp_path / "s.csv").open()))) == 20
    # the printed report carries the summary a plan comparison needs (report_to_sweep.py)
    script = Path(__file__).parents[2] / "benchmarks" / "plan" / "report_to_sweep.py"
    spec = importlib.util.spec_from_file_location("report_to_sweep", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rebuilt = module.parse(out)["runs"]
    assert [r["request_rate"] for r in rebuilt] == [50.0, 100.0]
    for got, want in zip(rebuilt, result["runs"], strict=True):
        assert set(got) <= set(want)
        for key in ("completed", "failed", "total_token_throughput", "p99_ttft_ms", "p99_tpot_ms"):
            assert got[key] == pytest.approx(want[key], abs=0.006), key
        assert got["server_steps"] == want["server_steps"] == 2 * 10 * 4
        for key in ("server_mean_step_ms", "server_mean_scheduler_ms", "server_tokens_per_step"):
            assert got[key] == pytest.approx(want[key], abs=0.06), key
    # a report without the Server block (another engine's server) rebuilds them as None
    plain = "\n".join(line for line in out.splitlines() if "Server" not in line)
    plain = "\n".join(
        line for line in plain.splitlines() if not line.startswith(tuple(module.SERVER_LABELS))
    )
    assert all(
        r[key] is None for r in module.parse(plain)["runs"] for key in module.SERVER_LABELS.values()
    )


@pytest.mark.parametrize(
    "bad",
    [
        ["--goodput", "ttft"],
        ["--goodput", "ttft:"],
        ["--goodput", "latency:5"],
        ["--sweep", "1,x"],
        ["--prompt-format", "token-ids"],  # needs a tokenizer; nothing listens to name one
        ["--request-rate", "0"],
        ["--extra-body", "[1]"],
        ["--num-client-processes", "many"],
    ],
)
def test_cli_bad_input_exits_2_with_a_message(
    bad: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["serve", "--base-url", "http://127.0.0.1:9", "--model", "m", "--disable-tqdm"]
    assert cli.main(base + bad) == 2
    assert capsys.readouterr().err.startswith("error: ")


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (["--temperature", "nan"], "--temperature must be finite and >= 0, got nan"),
        (["--temperature", "inf"], "--temperature must be finite and >= 0, got inf"),
        (["--extra-body", '{"x": NaN}'], "--extra-body holds NaN or Infinity"),
        (["--goodput", "ttft:-1"], "--goodput ttft: the SLO must be a number of ms >= 0, got -1"),
        (["--goodput", "ttft:nan"], "--goodput ttft: the SLO must be a number of ms >= 0, got nan"),
        (["--dataset-path", "p.jsonl"], "--dataset-path is read only with --dataset jsonl"),
        (["--sweep", "1,2", "--request-rate", "5"], "--request-rate is not used by --sweep"),
        (
            ["--sweep", "1,2", "--sweep-start-rate", "4"],
            "--sweep-start-rate is used by --sweep auto",
        ),
        (["--max-concurrency", "0"], "--max-concurrency must be >= 1, got 0"),
        (["--request-timeout", "nan"], "--request-timeout must be > 0 (or inf), got nan"),
        (["--burstiness", "1e-4", "--num-prompts", "5"], "burstiness 0.0001 is too small"),
    ],
)
def test_cli_bad_values_are_refused_naming_the_flag_and_value(
    bad: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["serve", "--base-url", "http://127.0.0.1:9", "--model", "m", "--disable-tqdm"]
    assert cli.main(base + bad) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err, err


def test_a_missing_bench_extra_is_named_with_its_install_command(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cli, "BENCH_EXTRA", ("tqdm", "nori_jax_no_such_module"))
    assert cli.main(["serve", "--model", "m"]) == 2
    err = capsys.readouterr().err
    assert "missing: nori_jax_no_such_module" in err and "pip install 'nori-jax[bench]'" in err


def _own_actions(p: argparse.ArgumentParser, skip: set[str]) -> list[argparse.Action]:
    return [
        a
        for a in p._actions
        if a.option_strings and a.dest != "help" and not skip & set(a.option_strings)
    ]


def test_every_bench_flag_has_a_help_line_with_its_default() -> None:
    from nori_jax.bench.offline import add_bench_offline_parser
    from nori_jax.engine_args import add_engine_args

    root = argparse.ArgumentParser()
    sub = root.add_subparsers()
    serve = cli.add_bench_serve_parser(sub)
    add_bench_offline_parser(sub)
    offline = sub.choices["offline"]
    engine = argparse.ArgumentParser()
    add_engine_args(engine)  # the engine's flags are documented with the engine
    engine_flags = {s for a in engine._actions for s in a.option_strings}
    for parser in (serve, offline):
        formatter = parser._get_formatter()
        actions = _own_actions(parser, engine_flags)
        assert len(actions) > 15
        for action in actions:
            text = formatter._expand_help(action) if action.help else ""
            assert "default" in text, (action.option_strings, text)


def test_ctrl_c_stops_cleanly_and_reports_what_completed(
    server: FakeServer, tmp_path: Path
) -> None:
    server.set(itl_s=0.05)  # 10 tokens: half a second per request, 10 requests a second
    rj = tmp_path / "partial.json"
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])
    }
    # As from a terminal: a suite run as a background job (`cmd &` in a script) hands its
    # children SIGINT ignored, and Python then installs no KeyboardInterrupt handler; the child
    # installs it itself (a preexec_fn would make this a fork of a JAX process, which JAX warns
    # against).
    restore_sigint_then_run = (
        "import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "runpy.run_module('nori_jax.bench', run_name='__main__', alter_sys=True)"
    )
    proc = subprocess.Popen(
        [
            sys.executable, "-c", restore_sigint_then_run, "serve", "--base-url", server.base_url,
            "--dataset", "fixed", "--num-prompts", "60", "--input-len", "8", "--output-len",
            "10", "--request-rate", "10", "--num-client-processes", "2", "--disable-tqdm",
            "--result-json", str(rj),
        ],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while len(server.stats()["sent"]) < 3:  # some requests have finished
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole group
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == cli.INTERRUPTED
    assert "Traceback" not in err and "Serving Benchmark Result" in out
    result = json.loads(rj.read_text())
    assert result["interrupted"] is True and 3 <= result["completed"] < 60
    assert "Interrupted (Ctrl-C): partial results" in out
    reasons = {e for e in result["errors"] if e}
    assert reasons <= {"interrupted before it was sent", "interrupted before it finished"}


def test_server_reported_prompt_counts_replace_estimates(server: FakeServer) -> None:
    """Without a tokenizer, input totals use the server's usage.prompt_tokens."""
    run = run_bench(server, {"input_len": 50})
    assert run.input_lens == [r.server_prompt_tokens for r in run.results]
    assert any("estimates" in w for w in run.warnings)


def test_a_rate_not_achieved_is_flagged_naming_the_client_side_queue() -> None:
    """10 req/s planned, but one concurrency slot let a request leave only every 1.1 s."""
    from nori_jax.bench.metrics import rate_warnings

    def result(i: int, queue_s: float) -> RequestResult:
        return RequestResult(i, 0.1 * i, 0.1 * i, 0.1 * i + queue_s, success=True)

    slow = [result(i, 1.0 * i) for i in range(10)]
    (warning,) = rate_warnings(slow, 10.0, max_concurrency=1)
    assert "requests left at 0.91 req/s, below the configured 10 req/s" in warning
    assert "--max-concurrency 1 slots (P99 queue time 8.91 s)" in warning
    assert "queued" not in rate_warnings(slow, 10.0, max_concurrency=None)[0]
    assert rate_warnings([result(i, 0.0) for i in range(10)], 10.0, max_concurrency=1) == []
    assert rate_warnings(slow, float("inf"), max_concurrency=1) == []
