"""The kernel's profiling path: a trace's summary (benchmarks/kernels/attention_profile.py) and
the clear errors of `profile_dir` where it cannot run. The trace itself needs a GPU."""

from __future__ import annotations

import importlib.util
import pathlib

import jax.numpy as jnp
import pytest
from kernel_cases import abstract_args

from pallas_kernels.ragged_paged_attention.pallas_attention import ragged_paged_attention_pallas
from pallas_kernels.ragged_paged_attention.tuning import TuningConfig

SCRIPT = pathlib.Path(__file__).parents[2] / "benchmarks" / "kernels" / "attention_profile.py"


def _profile_module():
    spec = importlib.util.spec_from_file_location("attention_profile", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _span(name, tid, begin_us, end_us):
    return [
        {"name": name, "ph": "B", "ts": begin_us, "pid": 1, "tid": tid},
        {"name": name, "ph": "E", "ts": end_us, "pid": 1, "tid": tid},
    ]


def test_summary_shares_counts_and_means_per_warpgroup():
    # Two CTAs of three warpgroups (tid = 1 + wg + 3 * cta); ts in the trace's units (SM
    # kilocycles within a warpgroup). Warpgroup 0 of CTA 0: qk 0-1, softmax 1-3, qk 3-4 (its
    # time: 4); of CTA 1: softmax 10-12 (2). Warpgroup 1 of CTA 0: one pv span 0-0.5 inside
    # nested spans (an outer span from 0 to 1).
    events = (
        _span("qk", 1, 0.0, 1.0)
        + _span("softmax", 1, 1.0, 3.0)
        + _span("qk", 1, 3.0, 4.0)
        + _span("softmax", 4, 10.0, 12.0)
        + [{"name": "outer", "ph": "B", "ts": 0.0, "pid": 1, "tid": 2}]
        + _span("pv", 2, 0.0, 0.5)
        + [{"name": "outer", "ph": "E", "ts": 1.0, "pid": 1, "tid": 2}]
    )
    rows = _profile_module().summarize({"traceEvents": events}, warpgroups_per_cta=3)
    assert rows[(0, "qk")] == {"share": pytest.approx(2 / 6), "count": 2, "mean_kcyc": 1.0}
    assert rows[(0, "softmax")] == {"share": pytest.approx(4 / 6), "count": 2, "mean_kcyc": 2.0}
    assert rows[(1, "pv")] == {"share": pytest.approx(0.5), "count": 1, "mean_kcyc": 0.5}
    assert rows[(1, "outer")]["share"] == pytest.approx(1.0)
    assert set(rows) == {(0, "qk"), (0, "softmax"), (1, "pv"), (1, "outer")}


def test_cta_ends_from_the_first_event():
    # Three CTAs of two warpgroups (tid = 1 + wg + 2 * cta); the call's first event at 5 us.
    # CTA 0 ends at 9 us (its warpgroup 1), CTA 1 at 20 us, CTA 2 at 12 us.
    events = (
        _span("qk", 1, 5.0, 8.0)
        + _span("pv", 2, 6.0, 9.0)
        + _span("qk", 3, 7.0, 20.0)
        + _span("qk", 6, 5.5, 12.0)
    )
    ends = _profile_module().cta_ends({"traceEvents": events}, warpgroups_per_cta=2)
    assert ends == {"min": 4.0, "median": 7.0, "max": 15.0, "truncated": False}
    capped = [e for i in range(1024) for e in _span("qk", 1, float(i), i + 0.5)]
    assert _profile_module().cta_ends({"traceEvents": capped}, 2)["truncated"]


def test_timeline_from_each_ctas_init_span():
    # Three CTAs of two warpgroups. CTA 0 (warpgroup 0, tid 1): Init at 100, its Q landed at
    # 102, K at 103.5 (its second wait_k, at 106, is not the first), last event 110. CTA 1 (tid
    # 3): Init at 50, Q at 54, K at 55, last event 58. CTA 2 (tid 5) has no Init span (its
    # first event is a qk) and CTA 3 (tid 7, its Init alone: no items) are left out. Warpgroup 1
    # (tid 2) is not the first: left out.
    events = (
        _span("Init", 1, 100.0, 100.5)
        + _span("wait_q", 1, 100.1, 102.0)
        + _span("wait_k", 1, 102.1, 103.5)
        + _span("wait_k", 1, 104.0, 106.0)
        + _span("pv", 1, 106.0, 110.0)
        + _span("wait_q", 2, 0.0, 1.0)
        + _span("Init", 3, 50.0, 50.3)
        + _span("wait_q", 3, 50.5, 54.0)
        + _span("wait_k", 3, 54.5, 55.0)
        + _span("qk", 3, 55.0, 58.0)
        + _span("qk", 5, 0.0, 1.0)
        + _span("wait_k", 5, 1.0, 2.0)
        + _span("Init", 7, 20.0, 20.6)
    )
    marks = _profile_module().timeline({"traceEvents": events}, warpgroups_per_cta=2)
    assert set(marks) == {"q", "k", "end"}
    assert marks["q"] == {"median": pytest.approx(3.0), "max": pytest.approx(4.0), "ctas": 2}
    assert marks["k"] == {"median": pytest.approx(4.25), "max": pytest.approx(5.0), "ctas": 2}
    assert marks["end"] == {"median": pytest.approx(9.0), "max": pytest.approx(10.0), "ctas": 2}


def _args(head_dim=64):
    return abstract_args(tokens=256, pages=64, seqs=4, pages_per_seq=16, head_dim=head_dim)


def test_profile_dir_errors_are_clear(tmp_path):
    with pytest.raises(ValueError, match="profiler runs on a GPU"):
        ragged_paged_attention_pallas.trace(
            *_args(), sm_scale=0.125, interpret=True, profile_dir=str(tmp_path)
        )
    # 128 x 2 stages of head_dim 128 take 192 KiB of SMEM: the profiler's 48 KiB do not fit.
    full = TuningConfig(128, 2, 1, 132)
    full.check_fits(128, 16, jnp.bfloat16)
    with pytest.raises(ValueError, match="with the profiler needs"):
        ragged_paged_attention_pallas.trace(
            *_args(128), sm_scale=0.1, tuning=full, interpret=False, profile_dir=str(tmp_path)
        )
    # The default head_dim-64 prefill tuning leaves room: it traces.
    ragged_paged_attention_pallas.trace(
        *_args(), sm_scale=0.125, interpret=False, profile_dir=str(tmp_path)
    )
