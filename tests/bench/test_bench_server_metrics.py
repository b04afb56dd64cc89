"""The server's engine steps over a run, read from its /metrics (server_metrics.py): the window
is the measured requests only, label sets are summed, and a server without them (or with a
broken /metrics) leaves the fields None while the run goes on."""

from __future__ import annotations

import io

import pytest
from bench_helpers import FakeServer, bench_config, run_bench

from nori_jax.bench.report import print_run, result_dict, sweep_table
from nori_jax.bench.run import prepare_workload, run_once
from nori_jax.bench.server_metrics import (
    ERROR_KEY,
    SERVER_KEYS,
    SHAPES_KEY,
    Snapshot,
    parse,
    window,
)


def test_the_window_holds_the_measured_requests_only(server: FakeServer) -> None:
    # the fake server's /metrics: every token sent is one 4 ms step with 0.5 ms of scheduling
    # and 0.25 ms of the core's I/O around it, shown twice (replica="0" and "1"), so the sums
    # double the steps and keep the means
    server.set(metrics="engine")
    cfg = bench_config(server, {"request_rate": 200.0, "warmup_requests": 3})
    workload = prepare_workload(cfg)
    run = run_once(cfg, workload, 200.0, lambda n: None)
    assert run.metrics["completed"] == 20
    prompt_tokens = sum(server.stats()["prompt_tokens"][3:])  # the warm-up came first
    s = run.server
    assert s["server_steps"] == 2 * 20 * 8  # not the warm-up's 3 * 8 tokens
    assert s["server_mean_step_ms"] == pytest.approx(4.0)
    assert s["server_mean_scheduler_ms"] == pytest.approx(0.5)
    assert s["server_mean_core_io_ms"] == pytest.approx(0.25)
    assert s["server_mean_ttft_ms"] == pytest.approx(15.0)  # the engine's own view
    assert s["server_tokens_per_step"] == pytest.approx((20 * 8 + prompt_tokens) / (20 * 8))
    assert s[ERROR_KEY] is None
    # launches by shape, both replicas summed: each request's first token a prefill launch
    shapes = [(r["bucket"], r["kind"], r["launches"]) for r in s[SHAPES_KEY]]
    assert shapes == [("16", "decode", 2 * 20 * 7), ("64", "prefill", 2 * 20)]
    assert [r["ms_per_launch"] for r in s[SHAPES_KEY]] == pytest.approx([4.0, 4.0])
    assert [r["share"] for r in s[SHAPES_KEY]] == pytest.approx([7 / 8, 1 / 8])
    result = result_dict(cfg, workload, run)
    assert {k: result[k] for k in SERVER_KEYS} == {k: s[k] for k in SERVER_KEYS}
    assert result[SHAPES_KEY] == s[SHAPES_KEY]
    out = io.StringIO()
    print_run(cfg, run, out)
    text = out.getvalue()
    assert "-------Server (engine steps, from /metrics)-------" in text
    assert "Engine steps:                            320" in text
    assert "Mean step time (ms):                     4.00" in text
    assert "------------ Launches by step shape -------------" in text
    assert "     16 decode         280     4.00   87.5%" in text
    assert "     64 prefill         40     4.00   12.5%" in text
    table = sweep_table([run]).splitlines()
    assert table[1].endswith("  step ms  sched ms  tok/step     io ms  eng TTFT")
    tok_step = f"{s['server_tokens_per_step']:.1f}"
    assert table[2].split()[-5:] == ["4.00", "0.500", tok_step, "0.250", "15.0"]


@pytest.mark.parametrize(
    ("metrics", "reason"),
    [
        (None, "HTTPError"),  # 404: vLLM without its metrics, a proxy
        ("<html>oops</html>\n", "unparsable"),
        ("garbage {{{\n", "unparsable"),
        ("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0.0\n", "no nori:"),
    ],
)
def test_without_usable_metrics_the_fields_are_none(
    server: FakeServer, metrics: str | None, reason: str
) -> None:
    server.set(metrics=metrics)
    run = run_bench(server, {"num_prompts": 6})
    assert run.metrics["completed"] == 6 and not [w for w in run.warnings if "metrics" in w]
    assert all(run.server[k] is None for k in SERVER_KEYS)
    assert reason in run.server[ERROR_KEY]
    out = io.StringIO()
    print_run(bench_config(server), run, out)
    assert "Not available: " in out.getvalue()
    assert "step ms" not in sweep_table([run])  # no server columns when no run has them


def test_no_server_at_all_leaves_the_fields_none() -> None:
    from nori_jax.bench.server_metrics import scrape

    reason = scrape("http://127.0.0.1:9", {}, timeout_s=2.0)  # discard port: refused
    assert isinstance(reason, str) and "/metrics" in reason
    assert window(reason, reason)["server_steps"] is None


def test_window_arithmetic_and_its_edge_cases() -> None:
    text = (
        "# TYPE nori:step_duration_seconds histogram\n"
        'nori:step_duration_seconds_bucket{le="+Inf"} 10.0\n'
        "nori:step_duration_seconds_count 10.0\n"
        "nori:step_duration_seconds_sum 0.05\n"
    )
    a = parse(text)
    assert a == Snapshot(step_count=10.0, step_sum=0.05)
    b = Snapshot(step_count=30.0, step_sum=0.25)
    w = window(a, b)  # no scheduler or token series: those stay None
    assert w["server_steps"] == 20 and w["server_mean_step_ms"] == pytest.approx(10.0)
    assert w["server_mean_scheduler_ms"] is None and w["server_tokens_per_step"] is None
    assert w["server_mean_core_io_ms"] is None
    idle = window(a, a)  # no step in the window: no mean
    assert idle["server_steps"] == 0 and idle["server_mean_step_ms"] is None
    back = window(b, a)  # a server restarted between the scrapes
    assert back["server_steps"] is None and "went back" in back[ERROR_KEY]
    with pytest.raises(ValueError, match="no nori:step_duration_seconds"):
        parse("")


def test_launches_by_shape_over_the_window() -> None:
    def text(launches: dict, seconds: dict) -> str:
        lines = [
            "nori:step_duration_seconds_count 1.0",
            "nori:step_duration_seconds_sum 1.0",
            "# TYPE nori:step_launches counter",
        ]
        for (bucket, kind, replica), n in launches.items():
            labels = f'bucket="{bucket}",kind="{kind}",replica="{replica}"'
            lines.append(f"nori:step_launches_total{{{labels}}} {n}")
        lines.append("# TYPE nori:step_launch_seconds counter")
        for (bucket, kind, replica), t in seconds.items():
            labels = f'bucket="{bucket}",kind="{kind}",replica="{replica}"'
            lines.append(f"nori:step_launch_seconds_total{{{labels}}} {t}")
        return "\n".join(lines) + "\n"

    before = parse(text({("128", "mixed", "0"): 5.0}, {("128", "mixed", "0"): 0.5}))
    assert before.shapes == {("128", "mixed"): (5.0, 0.5)}
    after = parse(
        text(
            {("128", "mixed", "0"): 7.0, ("1024", "decode", "1"): 1.0, ("16", "decode", "0"): 4.0,
             ("16", "decode", "1"): 6.0, ("2048", "prefill", "0"): 0.0},
            {("128", "mixed", "0"): 0.7, ("1024", "decode", "1"): 0.02, ("16", "decode", "0"): 0.04,
             ("16", "decode", "1"): 0.06, ("2048", "prefill", "0"): 0.0},
        )
    )  # fmt: skip
    rows = window(before, after)[SHAPES_KEY]
    # by bucket as a number (16 before 128 before 1024), replicas summed, no launch no row
    assert [(r["bucket"], r["kind"], r["launches"]) for r in rows] == [
        ("16", "decode", 10), ("128", "mixed", 2), ("1024", "decode", 1)
    ]  # fmt: skip
    assert [r["ms_per_launch"] for r in rows] == pytest.approx([10.0, 100.0, 20.0])
    assert [r["share"] for r in rows] == pytest.approx([0.1 / 0.32, 0.2 / 0.32, 0.02 / 0.32])
    # a server without the series: no rows, not an empty table
    plain = parse(text({}, {}))
    assert plain.shapes == {} and window(plain, plain)[SHAPES_KEY] is None
