"""The runner compiles each program as soon as it is lowered (runner.compile_all): lowering is
Python on one thread, compiling runs on a pool, so a cold start-up takes about the longer of the
two rather than their sum."""

from __future__ import annotations

import threading
import time

import jax
from tiny_multi_step import TINY_MULTI_STEP

from nori_jax import LLM


def test_compiling_starts_before_the_last_program_is_lowered(monkeypatch):
    lowered_at, compile_started_at = [], []
    lock = threading.Lock()
    lower, compile_ = jax.stages.Traced.lower, jax.stages.Lowered.compile

    def timed_lower(self, *args, **kwargs):
        out = lower(self, *args, **kwargs)
        with lock:
            lowered_at.append(time.perf_counter())
        return out

    def timed_compile(self, *args, **kwargs):
        with lock:
            compile_started_at.append(time.perf_counter())
        return compile_(self, *args, **kwargs)

    monkeypatch.setattr(jax.stages.Traced, "lower", timed_lower)
    monkeypatch.setattr(jax.stages.Lowered, "compile", timed_compile)
    llm = LLM("tiny-llama", **TINY_MULTI_STEP, param_cache=False)
    programs = llm.engine.runner.compiled_programs()
    assert len(compile_started_at) >= len(programs) > 10
    # the first compile began while later programs were still being lowered
    assert min(compile_started_at) < max(lowered_at)
