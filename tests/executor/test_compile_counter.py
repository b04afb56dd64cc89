"""The compile counter's scope: a program built on another thread is charged to the counters
the work was handed over under (what the runner's launch thread does), and to no others."""

from __future__ import annotations

import threading

import jax
import numpy as np

from nori_jax.executor import compile_counter
from nori_jax.executor.compile_counter import CompileCounter


def _compile_fresh_program() -> None:
    jax.jit(lambda x: x * 3 + 1)(np.ones(3, np.float32))  # a new function: lowered every call


def _events_of_one_program() -> int:
    """The events one fresh program charges (one lowering, with what it pulls in)."""
    counter = CompileCounter()
    with counter.counting():
        _compile_fresh_program()
    assert counter.count >= 1
    return counter.count


def _on_thread(fn) -> None:
    worker = threading.Thread(target=fn)
    worker.start()
    worker.join()


def test_counters_handed_to_another_thread_count_its_compiles():
    n = _events_of_one_program()
    handed, idle = CompileCounter(), CompileCounter()
    with handed.counting():
        counters = compile_counter.active_counters()
    assert counters == (handed,)

    def work():
        with compile_counter.counting_all(counters):
            _compile_fresh_program()
        _compile_fresh_program()  # outside the block: nobody's

    _on_thread(work)
    assert handed.count == n
    assert idle.count == 0


def test_a_counter_active_on_one_thread_does_not_count_another_threads_compiles():
    n = _events_of_one_program()
    counter = CompileCounter()
    with counter.counting():
        _on_thread(_compile_fresh_program)
        assert counter.count == 0
        _compile_fresh_program()
    assert counter.count == n
