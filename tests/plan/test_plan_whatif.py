"""What-if levers, disaggregated prefill/decode, and sizing under SLOs."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from plan_helpers import synthetic_calibration, with_costs

from nori_jax.bench.offline import OfflineConfig
from nori_jax.bench.run import RunResult
from nori_jax.bench.sweep import SweepConfig
from nori_jax.bench.workload import WorkloadConfig
from nori_jax.plan.calibration import KVTransfer
from nori_jax.plan.core_io import CoreIO
from nori_jax.plan.disaggregation import Side, simulate_disaggregated
from nori_jax.plan.planner import Planner, PlanSettings
from nori_jax.plan.simulator import Frontend, SimRequest, simulate
from nori_jax.plan.sizing import Slo, capacity, size
from nori_jax.plan.step_model import DEVICE_TERMS, LinearModel
from nori_jax.plan.whatif import WhatIf, sim_engine


def test_page_size_keeps_the_kv_memory_and_says_the_kernel_was_not_profiled_there():
    cal = synthetic_calibration()  # 512 usable pages of 16 tokens
    engine, warnings = sim_engine(cal, WhatIf(page_size=64))
    assert engine.num_pages - 1 == 512 * 16 // 64
    assert engine.scheduler.page_size == 64
    assert any("profiled at page size 16" in w for w in warnings)
    same, none = sim_engine(cal)
    assert same.num_pages == 513 and none == []


def test_levers_reach_the_scheduler():
    engine, warnings = sim_engine(
        synthetic_calibration(),
        WhatIf(
            kv_headroom=0.3,
            max_num_seqs=8,
            max_num_batched_tokens=128,
            long_prefill_threshold=500,
            enable_prefix_caching=False,
            async_scheduling=False,
        ),
    )
    s = engine.scheduler
    assert (s.kv_headroom, s.max_num_seqs, s.max_num_batched_tokens) == (0.3, 8, 128)
    assert s.long_prefill_threshold == 500 and not s.enable_prefix_caching
    assert not engine.async_scheduling
    assert any("max_num_seqs 8" in w for w in warnings)


def test_a_smaller_chunk_budget_trades_ttft_for_inter_token_latency():
    w = WorkloadConfig(dataset="fixed", num_prompts=60, input_len=900, output_len=16)

    def run(budget):
        p = Planner(
            synthetic_calibration(),
            PlanSettings(OfflineConfig(w), WhatIf(max_num_batched_tokens=budget)),
        )
        return p.run_at(30.0).run.metrics

    big, small = run(256), run(64)
    assert small["p99_ttft_ms"] > big["p99_ttft_ms"]  # a prompt takes more, cheaper steps
    assert small["p99_itl_ms"] < big["p99_itl_ms"]  # and a decode never waits out a big one


def test_multi_step_decode_runs_fewer_launches_for_the_same_tokens_and_is_warned():
    w = WorkloadConfig(dataset="fixed", num_prompts=24, input_len=100, output_len=40)

    def run(steps):
        p = Planner(
            synthetic_calibration(),
            PlanSettings(OfflineConfig(w), WhatIf(num_scheduler_steps=steps)),
        )
        out = p.run_at(2.0)
        return p, out.summary, out.run.metrics

    one, one_summary, one_metrics = run(1)
    eight, eight_summary, eight_metrics = run(8)
    assert eight.engine.scheduler.num_scheduler_steps == 8
    assert any("multi-step launch is modelled" in w for w in eight.warnings)
    assert not any("multi-step" in w for w in one.warnings)
    assert eight_summary["steps"] < one_summary["steps"] / 3  # a light load: nearly all decode
    assert eight_metrics["total_output_tokens"] == one_metrics["total_output_tokens"]


def test_kv_pool_and_headroom_change_what_the_scheduler_does():
    w = WorkloadConfig(dataset="fixed", num_prompts=40, input_len=200, output_len=200)
    settings = lambda **k: PlanSettings(OfflineConfig(w), WhatIf(**k))  # noqa: E731
    cal = synthetic_calibration()
    tight = Planner(cal, settings(num_pages=60, max_model_len=512)).run_at(math.inf)
    roomy = Planner(cal, settings(num_pages=1200)).run_at(math.inf)  # 40 x 25 pages fit
    assert tight.summary["num_preemptions"] > 0 and roomy.summary["num_preemptions"] == 0
    assert tight.run.metrics["completed"] == roomy.run.metrics["completed"] == 40
    # Admission keeping 60% of the pool free for growth: of 32 prompts of 25 pages each, about
    # 19 are admitted at once instead of all; the rest wait for them.
    long = WorkloadConfig(dataset="fixed", num_prompts=32, input_len=400, output_len=50)
    ttft = lambda h: (
        Planner(  # noqa: E731
            cal, PlanSettings(OfflineConfig(long), WhatIf(num_pages=1200, kv_headroom=h))
        )
        .run_at(math.inf)
        .run.metrics["p99_ttft_ms"]
    )
    assert ttft(0.6) > 1.2 * ttft(0.1)


def test_disaggregation_moves_kv_instead_of_recomputing_it():
    cal = synthetic_calibration()
    engine, _ = sim_engine(cal)
    rng = np.random.default_rng(0)
    reqs = [SimRequest(rng.integers(10, 500, 150).tolist(), 20, 0.02 * i) for i in range(30)]
    transfer = KVTransfer(1e8, 2e-3)  # 100 MB/s: 150 tokens x 512 B = 0.77 ms, + 2 ms
    res = simulate_disaggregated(
        Side(engine, cal.costs, 1),
        Side(engine, cal.costs, 2),
        reqs,
        transfer,
        cal.engine.kv_bytes_per_token,
        request_rate=50.0,
    )
    m = res.run.metrics
    assert m["completed"] == 30 and m["total_output_tokens"] == 30 * 20
    assert res.kv_recomputed == 0
    assert res.mean_transfer_s == pytest.approx(2e-3 + 150 * 512 / 1e8)
    # The decode pools computed only the last partial page of each prompt (+ its first token):
    # 150 + 1 tokens = 9 full pages cached and 7 tokens computed, then 18 decodes.
    decoded = sum(st.tokens for st in res.decode)
    assert decoded == 30 * (7 + 18)
    # Every request's first token came from the prefill engine; its second waited out the move.
    for r in res.run.results:
        assert r.itl_s[0] >= transfer.seconds(150 * 512)
    colocated = simulate(engine, cal.costs, reqs, request_rate=50.0)
    assert colocated.stats.tokens == 30 * (150 + 19)


def test_disaggregation_without_a_transfer_cost_is_a_clear_error():
    cal = synthetic_calibration()
    cal = type(cal)(**{**cal.__dict__, "kv_transfer": None})
    w = WorkloadConfig(dataset="fixed", num_prompts=4, input_len=20, output_len=4)
    with pytest.raises(ValueError, match="disaggregation needs a KV transfer cost"):
        Planner(cal, PlanSettings(OfflineConfig(w), disaggregate=(1, 1)))


def _fake_run(rate: float, saturation: float) -> RunResult:
    """Throughput follows the offer up to `saturation` req/s; past it P99 TTFT climbs."""
    ttft = 100.0 if rate <= saturation else 100.0 + 1e3 * (rate - saturation)
    metrics = {
        "completed": 100,
        "failed": 0,
        "total_token_throughput": 1e3 * min(rate, saturation),
        "p99_ttft_ms": ttft,
        "p99_tpot_ms": 10.0 + 0.1 * min(rate, saturation),
    }
    return RunResult(rate, metrics, [], [], {}, [])


def test_capacity_is_the_knee_when_the_slos_hold_there():
    found = capacity(Slo({"ttft": 1e4}), lambda r: _fake_run(r, 37.3), SweepConfig(start_rate=1.0))
    assert found.limited_by == "knee" and found.knee.rate == 32.0
    # Narrowed from the ramp's 32 to where a 10% step stops scaling: 37.3 / 1.05 = 35.5.
    assert 37.3 / 1.05 / 1.05 <= found.rate <= 37.3 / 1.05 <= found.broken_at
    assert found.broken_at <= found.rate * 1.05


def test_capacity_is_below_the_knee_when_the_slos_bind():
    # TPOT P99 = 10 + 0.1 * rate: 14 ms at 40 req/s, so a 13 ms bound binds at 30 req/s.
    found = capacity(Slo({"tpot": 13.0}), lambda r: _fake_run(r, 50.0), SweepConfig(start_rate=1.0))
    assert found.limited_by == "slo"
    assert found.rate <= 30.0 <= found.broken_at <= found.rate * 1.05


def test_capacity_restarts_a_ramp_that_began_past_the_knee():
    found = capacity(Slo({"ttft": 1e4}), lambda r: _fake_run(r, 3.0), SweepConfig(start_rate=50.0))
    # Restarted at 50/16 = 3.125 req/s, still past the knee, then at 3.125/16: the ramp now
    # climbs to 3.125, where the rule puts the knee, and the narrowing to 3 / 1.05.
    assert found.knee.rate == 3.125
    assert 3.0 / 1.05 / 1.05 <= found.rate <= 3.0 / 1.05


def test_a_ramp_without_a_knee_credits_what_its_last_run_served_as_a_lower_bound():
    """No knee within the ramp: the last rate was credited as the capacity, labelled as a knee:
    a short run offered 4e4 req/s that served 500 sized 4e4 req/s a replica."""

    def run(rate: float) -> RunResult:  # every request at once: tokens follow the offer
        result = _fake_run(rate, math.inf)
        result.metrics["request_throughput"] = min(rate, 500.0)
        return result

    found = capacity(Slo({"ttft": 1e4}), run, SweepConfig(start_rate=1e4, max_steps=3))
    assert found.limited_by == "ramp" and found.knee is None
    assert found.rate == 500.0 and found.run.request_rate == 4e4


def test_unreachable_slos_are_a_clear_error():
    with pytest.raises(ValueError, match="SLOs are out of reach"):
        capacity(Slo({"tpot": 5.0}), lambda r: _fake_run(r, 10.0), SweepConfig(start_rate=1.0))


def test_sizing_arithmetic():
    s = size(100.0, 30.0, 2, (1000.0, 250.0), gpu_hour_price=3.0)
    assert (s.replicas, s.gpus, s.rate_per_replica) == (4, 8, 25.0)
    assert s.cost_per_hour == 24.0
    assert s.cost_per_million_tokens == pytest.approx(24.0 / (100 * 3600 * 1000) * 1e6)
    assert s.cost_per_million_output_tokens == pytest.approx(24.0 / (100 * 3600 * 250) * 1e6)
    assert size(90.0, 30.0, 1, (1.0, 1.0), None).replicas == 3  # exactly at capacity
    with pytest.raises(ValueError, match="SLO bounds"):
        Slo({"latency": 5.0})


def test_long_prompt_isolation_shields_the_short_requests():
    # Steps whose tokens cost more (20 us each): a long prompt's full-budget chunks are slow.
    heavy = LinearModel(DEVICE_TERMS, (1e-3, 2e-5, 2e-8, 1e-9, 1e-6))
    cal = with_costs(synthetic_calibration(), device=heavy)
    w = WorkloadConfig(dataset="fixed", num_prompts=80, input_len=40, output_len=16)
    shaping = OfflineConfig(w, long_prompts=4, long_len=900)

    def ttft_p99(threshold):
        whatif = WhatIf(long_prefill_threshold=threshold, max_num_batched_tokens=256)
        p = Planner(cal, PlanSettings(shaping, whatif))
        run = p.run_at(60.0).run
        split = [[r.ttft_s for r, k in zip(run.results, p.drawn.is_long, strict=True) if k == x]
                 for x in (False, True)]  # fmt: skip
        assert [len(s) for s in split] == [76, 4]
        return [float(np.percentile(s, 99)) for s in split]

    # Without isolation a 900-token prompt takes whole steps' budgets; with it, at most a
    # quarter of each, so the short prompts behind it start sooner and the long ones later.
    (short_off, long_off), (short_on, long_on) = ttft_p99(0), ttft_p99(500)
    assert short_on < 0.7 * short_off
    assert long_on > long_off


def test_a_frontend_stage_caps_the_streamed_token_rate():
    cal = synthetic_calibration()
    engine, _ = sim_engine(cal)
    reqs = [SimRequest(list(range(10, 42)), 50, 0.0) for _ in range(20)]
    alone = simulate(engine, cal.costs, reqs, request_rate=math.inf)
    slow = simulate(engine, cal.costs, reqs, request_rate=math.inf, frontend=Frontend(0.0, 1e-3))
    # 1,000 streamed tokens at 1 ms each: the last token leaves the frontend after >= 1 s.
    assert slow.run.metrics["duration"] >= 1.0 > alone.run.metrics["duration"]
    assert slow.run.metrics["output_throughput"] <= 1000.0 + 1e-6
    assert slow.stats.steps == alone.stats.steps  # the core decides the same; only delivery lags


def test_several_api_servers_split_the_frontend_cost_by_request():
    """`--api-server-count 4`: each server streams its own requests' tokens, so four deliver the
    same tokens four times as fast; one server is the single FIFO above, exactly."""
    cal = synthetic_calibration()
    engine, _ = sim_engine(cal)
    reqs = [SimRequest(list(range(10, 42)), 50, 0.0) for _ in range(20)]
    one = simulate(engine, cal.costs, reqs, request_rate=math.inf, frontend=Frontend(0.0, 1e-3))
    four = simulate(
        engine, cal.costs, reqs, request_rate=math.inf, frontend=Frontend(0.0, 1e-3, servers=4)
    )
    assert four.stats.steps == one.stats.steps
    # 5 requests x 50 tokens per server at 1 ms each: the last leaves after >= 0.25 s, not 1 s.
    assert 0.25 <= four.run.metrics["duration"] < 0.5 * one.run.metrics["duration"]
    assert four.run.metrics["output_throughput"] <= 4000.0 + 1e-6
    # every token is delivered no earlier than the core produced it, in order per request
    for ts in four.token_times:
        assert ts == sorted(ts) and len(ts) == 50
    with pytest.raises(ValueError, match="servers must be >= 1"):
        Frontend(0.0, 1e-3, servers=0)


def test_a_frontend_latency_shifts_every_token_and_nothing_else():
    cal = synthetic_calibration()
    engine, _ = sim_engine(cal)
    reqs = [SimRequest(list(range(10, 42)), 20, 0.01 * i) for i in range(10)]
    base = simulate(engine, cal.costs, reqs, request_rate=100.0)
    late = simulate(engine, cal.costs, reqs, request_rate=100.0, frontend=Frontend(latency_s=0.005))
    assert late.stats.steps == base.stats.steps  # the core's decisions are the same
    for a, b in zip(base.token_times, late.token_times, strict=True):
        assert b == pytest.approx([t + 0.005 for t in a])
    m, n = base.run.metrics, late.run.metrics
    assert n["mean_ttft_ms"] == pytest.approx(m["mean_ttft_ms"] + 5.0)
    assert n["mean_tpot_ms"] == pytest.approx(m["mean_tpot_ms"])
    with pytest.raises(
        ValueError, match=r"latency_s \(--frontend-latency-ms\) must be finite and >= 0"
    ):
        Frontend(latency_s=-1.0)


def test_a_requests_own_frontend_cost_delays_its_way_to_the_core_in_its_servers_fifo():
    """`request_s`: a request takes its API server that long on arrival, before the core sees
    it. Alone (requests far apart) every token shifts by it; arriving together on one server
    they queue, so the k-th reaches the core after k + 1 of them; two servers halve the queue."""
    cal = synthetic_calibration()
    engine, _ = sim_engine(cal)
    apart = [SimRequest(list(range(10, 42)), 10, 1.0 * i) for i in range(4)]
    base = simulate(engine, cal.costs, apart, request_rate=1.0)
    slow = simulate(engine, cal.costs, apart, request_rate=1.0, frontend=Frontend(request_s=0.02))
    for a, b in zip(base.token_times, slow.token_times, strict=True):
        assert b == pytest.approx([t + 0.02 for t in a])

    burst = [SimRequest(list(range(10, 42)), 10, 0.0) for _ in range(6)]
    for servers, waves in ((1, 6), (2, 3)):
        front = Frontend(request_s=0.05, servers=servers)
        run = simulate(engine, cal.costs, burst, request_rate=math.inf, frontend=front)
        first = sorted(ts[0] for ts in run.token_times)
        # the last request reached the core only after `waves` request costs on its server
        assert first[-1] >= 0.05 * waves
        assert first[-1] < 0.05 * waves + 0.05  # and then its prefill, well under 50 ms here
    with pytest.raises(ValueError, match=r"request_s \(--frontend-ms-per-request\) must be"):
        Frontend(request_s=-1e-3)


def test_the_core_send_path_delays_each_step_by_its_rows():
    """The engine core's send after every step (core_io.py) is host time on the core's clock:
    with 1 ms per step, every iteration that runs a step takes 1 ms longer, and the tokens
    leave after it."""
    cal = synthetic_calibration()
    engine, _ = sim_engine(cal)
    reqs = [SimRequest(list(range(10, 42)), 30, 0.0) for _ in range(8)]
    base = simulate(engine, cal.costs, reqs, request_rate=math.inf)
    io = simulate(engine, cal.costs, reqs, request_rate=math.inf, core_io=CoreIO(1e-3, 0.0))
    assert io.stats.steps == base.stats.steps
    extra = io.stats.host_busy_s - base.stats.host_busy_s
    # one send per loop iteration with a step or outputs: the steps, plus the final drain
    assert extra == pytest.approx(1e-3 * (base.stats.steps + 1))
    # host time the device partly hides (overlapped scheduling), but no token leaves earlier
    assert io.run.metrics["duration"] > base.run.metrics["duration"]
    for a, b in zip(base.token_times, io.token_times, strict=True):
        assert all(y >= x for x, y in zip(a, b, strict=True))
    per_row = simulate(engine, cal.costs, reqs, request_rate=math.inf, core_io=CoreIO(0.0, 1e-4))
    tokens = sum(r.output_len for r in reqs)
    assert per_row.stats.host_busy_s - base.stats.host_busy_s == pytest.approx(1e-4 * tokens)


def test_the_planner_takes_the_calibrations_send_path_for_its_api_servers():
    cal = dataclasses.replace(
        synthetic_calibration(), core_io={1: CoreIO(1e-6, 0.0), 4: CoreIO(2e-5, 1e-7)}
    )
    w = WorkloadConfig(dataset="fixed", num_prompts=4, input_len=8, output_len=4)
    shaping = OfflineConfig(w)
    assert Planner(cal, PlanSettings(shaping)).core_io == CoreIO(1e-6, 0.0)
    four = PlanSettings(shaping, frontend=Frontend(servers=4))
    assert Planner(cal, four).core_io == CoreIO(2e-5, 1e-7)
    two = PlanSettings(shaping, frontend=Frontend(servers=2))
    assert Planner(cal, two).core_io == CoreIO()  # none calibrated for 2: not modelled, said
    assert any("for [1, 4] API servers, not 2" in w for w in Planner(cal, two).warnings)
    assert not any("API servers" in w for w in Planner(cal, four).warnings)
    given = dataclasses.replace(four, core_io=CoreIO(5e-6, 0.0))
    assert Planner(cal, given).core_io == CoreIO(5e-6, 0.0)
    with pytest.raises(ValueError, match="core I/O step_s=-1"):
        CoreIO(-1.0, 0.0)
