"""`nori-jax plan simulate / sweep / size` end to end on a synthetic calibration file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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


def test_a_repeated_slo_or_goodput_name_is_refused(cal_file, capsys):
    size = ["plan", "size", "--calibration", cal_file, *WORKLOAD, "--target-rate", "10"]
    assert main([*size, "--slo", "e2el:1", "e2el:1000"]) == 2
    assert "--slo names e2el more than once" in capsys.readouterr().err
    sim = ["plan", "simulate", "--calibration", cal_file, *WORKLOAD]
    assert main([*sim, "--goodput", "ttft:100", "ttft:5"]) == 2
    assert "--goodput names ttft more than once" in capsys.readouterr().err


def test_kv_transfer_latency_alone_keeps_the_calibrated_bandwidth(cal_file, tmp_path, capsys):
    base = ["plan", "simulate", "--calibration", cal_file, *WORKLOAD, "--disaggregate", "1:1"]
    out = tmp_path / "sim.json"
    assert main([*base, "--kv-transfer-latency-ms", "50", "--result-json", str(out)]) == 0
    ms = json.loads(out.read_text())["simulated"]["mean_kv_transfer_ms"]
    # 50 ms + 64 tokens x 512 bytes at the calibration's 1 GB/s, not its 1 ms latency
    assert ms == pytest.approx(50 + 1e3 * 64 * 512 / 1e9, rel=0.05)
    for bad in ("-1", "nan", "inf"):
        assert main([*base, "--kv-transfer-latency-ms", bad]) == 2
        assert "--kv-transfer-latency-ms must be finite and >= 0" in capsys.readouterr().err
    assert main([*base, "--kv-transfer-gbps", "0"]) == 2
    assert "--kv-transfer-gbps must be finite and > 0" in capsys.readouterr().err


def test_one_core_io_part_given_keeps_the_calibrations_other(tmp_path, capsys):
    import dataclasses

    from nori_jax.plan.core_io import CoreIO

    cal = dataclasses.replace(synthetic_calibration(), core_io={1: CoreIO(3e-6, 2e-7)})
    path = str(save_calibration(cal, tmp_path / cal.key.filename))
    base = ["plan", "simulate", "--calibration", path, *WORKLOAD, "--num-prompts", "4"]
    assert main([*base, "--core-io-us-per-step", "5"]) == 0
    assert "5.0 us per step + 0.200 us per token" in capsys.readouterr().out
    assert main([*base, "--core-io-us-per-row", "0.5"]) == 0
    assert "3.0 us per step + 0.500 us per token" in capsys.readouterr().out
    assert main([*base, "--core-io-us-per-row", "nan"]) == 2
    assert "--core-io-us-per-row must be finite and >= 0" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flag",
    [
        "--frontend-latency-ms",
        "--frontend-us-per-token",
        "--frontend-ms-per-step",
        "--frontend-ms-per-request",
    ],
)
def test_infinite_frontend_costs_are_refused_by_name(cal_file, capsys, flag):
    argv = ["plan", "simulate", "--calibration", cal_file, *WORKLOAD, flag, "inf"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"({flag}) must be finite and >= 0" in err and "Traceback" not in err


def test_zero_is_refused_not_read_as_the_default(cal_file, capsys):
    sim = ["plan", "simulate", "--calibration", cal_file, *WORKLOAD]
    assert main([*sim, "--num-pages", "0"]) == 2
    assert "--num-pages 0 must be >= 2" in capsys.readouterr().err
    sweep = ["plan", "sweep", "--calibration", cal_file, *WORKLOAD, "--sweep-start-rate", "0"]
    assert main(sweep) == 2
    assert "start_rate must be finite and > 0, got 0" in capsys.readouterr().err
    size = ["plan", "size", "--calibration", cal_file, *WORKLOAD, "--target-rate", "10"]
    assert main([*size, "--slo", "ttft:100", "--search-start-rate", "0"]) == 2
    assert "start_rate must be finite and > 0, got 0" in capsys.readouterr().err


def test_huge_num_pages_is_a_clear_error(cal_file, capsys):
    argv = ["plan", "simulate", "--calibration", cal_file, *WORKLOAD, "--num-pages", "99999999999"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--num-pages 99999999999 must be >= 2" in err and "<= 16,777,216" in err


def test_output_paths_are_checked_before_simulating(cal_file, tmp_path, capsys):
    sim = ["plan", "simulate", "--calibration", cal_file, *WORKLOAD]
    assert main([*sim, "--result-json", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert "--result-json" in err and "is a directory" in err and "Calibration:" not in out
    assert main([*sim, "--result-json", str(tmp_path / "missing" / "r.json")]) == 2
    out, err = capsys.readouterr()
    assert "does not exist" in err and "Calibration:" not in out
    sweep = ["plan", "sweep", "--calibration", cal_file, *WORKLOAD, "--sweep", "10,40"]
    assert main([*sweep, "--result-json", str(tmp_path)]) == 2
    assert "Calibration:" not in capsys.readouterr().out
    size = ["plan", "size", "--calibration", cal_file, *WORKLOAD, "--target-rate", "10"]
    assert main([*size, "--slo", "ttft:100", "--result-json", str(tmp_path)]) == 2
    assert "Calibration:" not in capsys.readouterr().out


def test_sweep_plot_prints_the_file_it_wrote(cal_file, tmp_path, capsys, monkeypatch):
    import nori_jax.bench.plot
    import nori_jax.plan.cli

    written = []
    monkeypatch.setattr(nori_jax.plan.cli, "_has_matplotlib", lambda: True)
    monkeypatch.setattr(
        nori_jax.bench.plot, "plot_sweep", lambda r, k, path, t: written.append(path)
    )
    sweep = ["plan", "sweep", "--calibration", cal_file, *WORKLOAD, "--sweep", "10,40"]
    assert main([*sweep, "--plot", str(tmp_path / "knee")]) == 0
    assert written == [str(tmp_path / "knee.png")]
    assert f"Plot: {tmp_path / 'knee.png'}\n" in capsys.readouterr().out
    assert main([*sweep, "--plot", str(tmp_path)]) == 0  # writes tmp_path.png beside it
    assert written[-1] == f"{tmp_path}.png" and f"Plot: {tmp_path}.png" in capsys.readouterr().out
    assert main([*sweep, "--plot", str(tmp_path / "no" / "k.png")]) == 2
    assert "--plot" in capsys.readouterr().err


def test_an_infinite_gpu_hour_price_is_refused(cal_file, capsys):
    from nori_jax.plan.sizing import size

    with pytest.raises(ValueError, match="GPU-hour price must be finite"):
        size(10.0, 5.0, 1, (80.0, 16.0), float("inf"))
    argv = ["plan", "size", "--calibration", cal_file, *WORKLOAD, "--target-rate", "10"]
    assert main([*argv, "--slo", "ttft:100", "--gpu-hour-price", "inf"]) == 2
    out, err = capsys.readouterr()
    assert "--gpu-hour-price must be finite and >= 0" in err and "Calibration:" not in out


def test_a_calibration_directory_is_named_as_one(cal_file, capsys):
    directory = str(Path(cal_file).parent)
    assert main(["plan", "simulate", "--calibration", directory, *WORKLOAD]) == 2
    err = capsys.readouterr().err
    assert f"calibration file {directory!r} is a directory" in err and "not found" not in err


def test_a_calibration_file_not_utf8_is_named(tmp_path, capsys):
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"format: 1\nsource: caf\xe9\n")
    assert main(["plan", "simulate", "--calibration", str(path), *WORKLOAD]) == 2
    assert f"{path}: not UTF-8 (line 2: byte 0xe9" in capsys.readouterr().err


@pytest.mark.parametrize(
    "old, new, says",
    [
        ("  tp: 1\n", "  tp: [1\n", "not YAML (line 8, column 7: expected ',' or ']'"),
        ("  num_pages: 513", "  num_pages: lots", "engine num_pages='lots' must be an integer"),
        ("  dtype: float32", "  dtype: 5", "key dtype=5 must be a string"),
        ("feature_max: {}", "feature_max: [1, 2]", "feature_max: expected a mapping"),
        ("host_seconds:\n", "host_seconds: [1]\nold:\n", "host_seconds: expected a mapping"),
        ("launch_wait: 0.0", "launch_wait: soon", "could not convert string to float"),
    ],
)
def test_a_corrupt_calibration_value_is_a_clean_error_naming_the_file(
    cal_file, capsys, old, new, says
):
    text = Path(cal_file).read_text()
    assert old in text
    Path(cal_file).write_text(text.replace(old, new, 1))
    assert main(["plan", "simulate", "--calibration", cal_file, *WORKLOAD]) == 2
    assert f"error: {cal_file}: {says}" in capsys.readouterr().err


def test_a_corrupt_engine_config_is_a_clean_error_naming_the_file(tmp_path, capsys):
    config = tmp_path / "engine.yaml"
    config.write_text("max_num_seqs: [1\npage_size: 16\n")
    assert main(["plan", "calibrate", "--config", str(config)]) == 2
    assert f"error: {config}: not YAML (line 2, column 10: " in capsys.readouterr().err


def _help(command: str) -> dict[str, str]:
    """Each flag's help line of `plan COMMAND`, as --help prints it."""
    import argparse

    from nori_jax.plan.cli import add_plan_args

    parser = argparse.ArgumentParser()
    add_plan_args(parser)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    formatter = sub.choices[command]._get_formatter()
    return {
        a.option_strings[-1]: formatter._get_help_string(a)
        for a in sub.choices[command]._actions
        if a.option_strings
    }


def test_help_says_the_calibrated_engines_default_only_where_it_is():
    engine = ("--page-size", "--max-num-seqs", "--max-num-batched-tokens", "--max-model-len")
    for command in ("simulate", "sweep", "size"):
        for flag, text in _help(command).items():
            assert ("the calibrated engine's" in text) == (flag in engine), (command, flag, text)
    simulate = _help("simulate")
    for flag in ("--model", "--dtype", "--kv-dtype", "--device", "--tp"):
        assert "(default: any" in simulate[flag]
    assert "(default: the scheduler's, 0.1)" in simulate["--kv-headroom"]
    assert "(default: the scheduler's, 1)" in simulate["--num-scheduler-steps"]
    assert "default: none" in simulate["--max-num-waiting"]
    assert "default: none" in _help("sweep")["--measured"]
    size = _help("size")
    assert "default" not in size["--target-rate"] and "default" not in size["--slo"]


@pytest.mark.parametrize("rate", ["nan", "inf", "-1", "0"])
def test_target_rate_is_checked_before_simulating(cal_file, capsys, rate):
    argv = ["plan", "size", "--calibration", cal_file, *WORKLOAD, "--slo", "ttft:100"]
    assert main([*argv, f"--target-rate={rate}"]) == 2
    out, err = capsys.readouterr()
    assert f"--target-rate must be finite and > 0, got {float(rate)}" in err
    assert "Calibration:" not in out


def test_a_measured_sweep_not_utf8_is_named(cal_file, tmp_path, capsys):
    measured = tmp_path / "latin1.json"
    measured.write_bytes(b'{"runs": "caf\xe9"}')
    argv = ["plan", "sweep", "--calibration", cal_file, *WORKLOAD, "--measured", str(measured)]
    assert main(argv) == 2
    assert f"cannot read the measured sweep '{measured}'" in capsys.readouterr().err
