"""A frontend in the core's process (LLMEngine) asks for each request's whole output with its
finish (`EngineCoreRequest.final_token_ids`), and its output processor then keeps no per-step
list for final-only requests: the outputs are exactly those of a processor fed every token."""

from __future__ import annotations

import time

import msgspec
import numpy as np
import pytest
from fake_runner import FakeDevice, FakeExecutor, make_scheduler

from nori_jax.core.engine_core import EngineCore, EngineCoreRequest
from nori_jax.core.output_processor import OutputProcessor
from nori_jax.core.outputs import EngineCoreOutputs, FinishedRequest, RequestMetrics
from nori_jax.sampling_params import SamplingParams


def _logprobs(n: int) -> np.ndarray:
    return np.linspace(-1.0, 0.0, n, dtype=np.float32)  # values a wrong copy would not match


def _settings(i: int) -> tuple[SamplingParams, bool]:
    """Final-only, streamed, and final-only with logprobs (which keeps its per-step list)."""
    params = SamplingParams(max_tokens=3 + i * 7 % 40, temperature=0.0, ignore_eos=True)
    if i % 3 == 2:
        params.logprobs = 0
    return params, i % 3 == 1


def _run(final_ids: bool, overlap: bool, num_pages: int) -> tuple[list, list]:
    s = make_scheduler(num_pages=num_pages, max_model_len=128, kv_headroom=0.0)
    core = EngineCore(
        s, s._builder, FakeExecutor(FakeDevice(s), _logprobs), async_scheduling=overlap
    )
    proc = OutputProcessor(None)
    rng = np.random.default_rng(0)
    for i in range(24):
        params, stream = _settings(i)
        prompt = rng.integers(3, 900, int(rng.integers(1, 60))).tolist()
        req = EngineCoreRequest(f"r{i}", prompt, params, 0, [], time.monotonic(), final_ids)
        core.add_request(req)
        proc.add(f"r{i}", None, prompt, params, (), stream, final_ids_from_core=final_ids)
    emitted, finishes = [], []
    aborted = False
    while core.has_unfinished() or core.has_in_flight:
        out = core.step() if core.has_unfinished() else core.drain()
        finishes += out.finished
        outputs, ended = proc.process(out)
        assert not ended
        emitted += outputs
        if not aborted and len(s.running) > 2:  # an abort mid-run: its finish carries the ids
            aborted = True
            f = core.abort(s.running[1].request_id)
            finishes.append(f)
            emitted.append(proc.finish(f))
        s.check_invariants()
    assert len(proc) == 0
    assert (s.counters.num_preemptions > 0) == (num_pages < 64)
    return emitted, finishes


def _key(o):
    return (o.request_id, o.new_token_ids, o.finished, o.finish_reason, o.token_ids, o.logprobs)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("num_pages", [64, 20])  # 20: preemptions (tokens recomputed)
def test_outputs_equal_those_of_a_processor_fed_every_token(overlap, num_pages):
    per_step, per_step_finishes = _run(False, overlap, num_pages)
    at_finish, finishes = _run(True, overlap, num_pages)
    assert [_key(o) for o in at_finish] == [_key(o) for o in per_step]
    assert all(f.token_ids is None for f in per_step_finishes)
    done = {o.request_id: o for o in at_finish if o.finished}
    assert len(done) == 24
    for f in finishes:
        assert f.token_ids == done[f.request_id].token_ids
        assert len(f.token_ids) == f.num_output_tokens


def test_finished_request_with_token_ids_crosses_msgpack():
    f = FinishedRequest("r", "length", 2, 3, RequestMetrics(*[None] * 5, 0, 0), None, [7, 8, 9])
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(f), type=FinishedRequest) == f


def test_rows_are_skipped_only_while_every_stream_takes_its_ids_at_the_finish():
    proc = OutputProcessor(None)
    params = SamplingParams(max_tokens=4)
    proc.add("plain", None, [1], params, stream=False, final_ids_from_core=True)
    proc.add("streamed", None, [1], params, stream=True, final_ids_from_core=True)
    rows = EngineCoreOutputs(["plain", "streamed"], np.int32([5, 6]).tobytes(), b"", [], [])
    outputs, _ = proc.process(rows)
    assert [(o.request_id, o.new_token_ids) for o in outputs] == [("streamed", [6])]
    assert proc._streams["plain"].token_ids == []  # nothing kept per step: they come at the finish
    proc.drop("streamed")
    proc.add("streamed2", None, [1], params, stream=True, final_ids_from_core=True)
    rows = EngineCoreOutputs(["streamed2"], np.int32([7]).tobytes(), b"", [], [])
    assert [o.new_token_ids for o in proc.process(rows)[0]] == [[7]]  # the count survived drop
    proc.drop("streamed2")
    done = FinishedRequest("plain", "length", 1, 2, RequestMetrics(*[None] * 5, 0, 0), None, [5, 9])
    (final,), _ = proc.process(
        EngineCoreOutputs(["plain"], np.int32([9]).tobytes(), b"", [done], [])
    )
    assert final.finished and final.token_ids == [5, 9] and final.new_token_ids == []


def test_a_finish_without_the_ids_it_was_promised_is_an_error():
    proc = OutputProcessor(None)
    proc.add("r", None, [1], SamplingParams(max_tokens=2), stream=False, final_ids_from_core=True)
    with pytest.raises(RuntimeError, match="carries no token ids"):
        proc.finish(FinishedRequest("r", "length", 1, 2, RequestMetrics(*[None] * 5, 0, 0)))
