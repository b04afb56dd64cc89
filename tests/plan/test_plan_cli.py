"""`nori-jax plan simulate / sweep / size` end to end on a synthetic calibration file."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from plan_helpers import synthetic_calibration

from nori_jax.cli import main
from nori_jax.plan.calibration import save_calibration

WORKLOAD = ["--dataset", "fixed", "--input-len", "64", "--output-len", "16", "--num-prompts", "40"]


@pytest.fixture
def cal_file(tmp_path):
    cal = synthetic_calibration()
    return str(save_calibration(cal, tmp_path / "cal" / cal.key.filename))


def test_simulate_prints_the_bench_serve_block_and_writes_json(cal_file, tmp_path, capsys):
    out = tmp_path / "sim.json"
    argv = ["plan", "simulate", "--calibration", cal_file, *WORKLOAD, "--request-rate", "20"]
    assert main([*argv, "--goodput", "ttft:100", "--result-json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "Serving Benchmark Result" in text and "Request goodput (req/s):" in text
    assert "Calibration: model=tiny-llama" in text
    result = json.loads(out.read_text())
    assert result["completed"] == 40 and result["request_rate"] == 20.0
    assert result["total_output_tokens"] == 40 * 16
    assert result["simulated"]["steps"] > 0 and "p99_ttft_ms" in result


def test_sweep_finds_a_knee_and_compares_with_a_measured_sweep(cal_file, tmp_path, capsys):
    first = tmp_path / "first.json"
    argv = ["plan", "sweep", "--calibration", cal_file, *WORKLOAD, "--sweep-start-rate", "20"]
    assert main([*argv, "--result-json", str(first)]) == 0
    text = capsys.readouterr().out
    assert "Rate sweep" in text and "Knee: " in text
    sweep = json.loads(first.read_text())
    assert sweep["knee_request_rate"] is not None
    # The simulated sweep's JSON has bench serve's layout, so it serves as a "measured" one: the
    # same rates come back with no error at all, and the same knee.
    plot = tmp_path / "vs.png"
    second = tmp_path / "second.json"
    argv = ["plan", "sweep", "--calibration", cal_file, *WORKLOAD, "--measured", str(first)]
    assert main([*argv, "--plot", str(plot), "--result-json", str(second)]) == 0
    text = capsys.readouterr().out
    assert "Simulated vs measured" in text
    again = json.loads(second.read_text())
    assert again["request_rates"] == sweep["request_rates"]
    assert again["measured_knee_request_rate"] == sweep["knee_request_rate"]
    assert all(
        c["rel_error"] == 0.0
        for row in again["comparison"]
        for k, c in row.items()
        if k != "request_rate"
    )
    assert plot.stat().st_size > 10_000


def test_size_answers_replicas_and_cost(cal_file, tmp_path, capsys):
    out = tmp_path / "size.json"
    argv = ["plan", "size", "--calibration", cal_file, *WORKLOAD, "--target-rate", "400"]
    argv += ["--slo", "ttft:200", "tpot:30", "--gpu-hour-price", "2.5", "--search-start-rate", "50"]
    assert main([*argv, "--result-json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "Sizing" in text and "400 req/s within ttft:200 tpot:30 (P99)" in text
    layout = json.loads(out.read_text())["layouts"][0]
    assert layout["replicas"] * layout["max_rate_per_replica"] >= 400
    assert layout["metrics_at_share"]["p99_ttft_ms"] <= 200
    assert layout["cost_per_hour"] == pytest.approx(2.5 * layout["gpus"])


def test_uncalibrated_combination_exits_2_with_the_reason(cal_file, tmp_path, capsys):
    argv = ["plan", "simulate", "--calibration", cal_file, *WORKLOAD, "--kv-dtype", "fp8"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "uncalibrated combination: kv_dtype=fp8" in err and "nori-jax plan calibrate" in err
    empty = tmp_path / "none"
    assert main(["plan", "sweep", "--calibration-dir", str(empty), "--model", "x", *WORKLOAD]) == 2
    assert "uncalibrated combination: model=x" in capsys.readouterr().err
    argv = ["plan", "simulate", "--calibration", cal_file, *WORKLOAD, "--disaggregate", "1"]
    assert main(argv) == 2
    assert "--disaggregate wants P:D" in capsys.readouterr().err


def test_the_plan_package_imports_no_jax():
    code = (
        "import importlib, pkgutil, sys\n"
        "import nori_jax.plan\n"
        "for m in pkgutil.iter_modules(nori_jax.plan.__path__):\n"
        "    importlib.import_module('nori_jax.plan.' + m.name)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax'))\n"
        "print(len(bad), bad[:5])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("0 "), out.stdout + out.stderr


def test_bad_flags_are_clear_errors(cal_file, capsys):
    base = ["plan", "simulate", "--calibration", cal_file, *WORKLOAD]
    assert main([*base, "--goodput", "itl:5"]) == 2
    assert "goodput wants NAME:MS" in capsys.readouterr().err
    assert main([*base, "--page-size", "48"]) == 2
    assert "page_size=48 must be a power of two" in capsys.readouterr().err
    assert main(["plan", "sweep", "--calibration", cal_file, *WORKLOAD, "--sweep", "4,x"]) == 2
    assert "--sweep wants comma-separated numbers" in capsys.readouterr().err
    size = ["plan", "size", "--calibration", cal_file, *WORKLOAD, "--target-rate", "10"]
    assert main([*size, "--slo", "ttft"]) == 2
    assert "--slo wants NAME:MS" in capsys.readouterr().err


def test_sweep_compares_the_mean_step_when_the_measured_runs_carry_it(cal_file, tmp_path, capsys):
    """`bench serve` against this engine's server adds server_mean_step_ms (its /metrics); the
    comparison then shows the simulated mean step beside it."""
    sim = tmp_path / "sim.json"
    argv = ["plan", "sweep", "--calibration", cal_file, *WORKLOAD, "--sweep", "10,40"]
    assert main([*argv, "--result-json", str(sim)]) == 0
    text = capsys.readouterr().out
    assert "step ms" not in text  # simulated runs have no server columns
    sweep = json.loads(sim.read_text())
    step_ms = [r["simulated"]["mean_step_ms"] for r in sweep["runs"]]
    # busy time over steps: at least the device's mean step, at most the run's length per step
    for r, ms in zip(sweep["runs"], step_ms, strict=True):
        assert r["simulated"]["mean_device_ms_per_step"] <= ms
        assert ms <= 1e3 * r["duration"] / r["simulated"]["steps"]
    measured = tmp_path / "measured.json"
    for r, ms in zip(sweep["runs"], step_ms, strict=True):
        r["server_mean_step_ms"] = 2 * ms  # the served steps twice as slow
    sweep["runs"][0]["server_mean_step_ms"] = None  # a rate the server gave no numbers for
    measured.write_text(json.dumps(sweep))
    out = tmp_path / "vs.json"
    argv = ["plan", "sweep", "--calibration", cal_file, *WORKLOAD, "--measured", str(measured)]
    assert main([*argv, "--result-json", str(out)]) == 0
    text = capsys.readouterr().out
    table = text[text.index("Simulated vs measured") :].splitlines()
    assert "step ms sim / measured" in table[1]
    assert table[2].rstrip().endswith("-")  # rate 10: no measured step
    assert table[3].rstrip().endswith(f"{step_ms[1]:.2f} / {2 * step_ms[1]:<13.2f}   -50%")
    rows = json.loads(out.read_text())["comparison"]
    assert "server_mean_step_ms" not in rows[0]
    assert rows[1]["server_mean_step_ms"]["rel_error"] == pytest.approx(-0.5)


def test_simulated_mean_step_is_the_busy_time_over_the_steps():
    from nori_jax.bench.client import RequestResult
    from nori_jax.bench.run import RunResult
    from nori_jax.plan.compare import simulated_step_ms

    def done(sent: float, latency: float) -> RequestResult:
        return RequestResult(0, sent, sent, sent, success=True, error="", latency_s=latency)

    # [0, 1) and [0.5, 2) overlap: busy 2 s; idle until 5; [5, 6): 1 s; a failure counts nothing
    results = [done(0.0, 1.0), done(0.5, 1.5), done(5.0, 1.0), RequestResult(3, 7.0)]
    run = RunResult(1.0, {}, results, [], {}, [])
    assert simulated_step_ms(run, 300) == pytest.approx(10.0)
    assert simulated_step_ms(run, 0) is None
